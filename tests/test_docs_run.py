"""The docs run: every code block of README.md and docs/*.md is executed here, or carries a marker
saying why not, and every `gppo` command of the docs parses with its command's parser.

Markers are an HTML comment on the line right before the opening fence:

- `<!-- not run: REASON -->`: not executed (REASON says why: needs a GPU, needs the Hub, takes N
  minutes, installs packages). Its `gppo` commands are still parsed.
- `<!-- run with: FLAGS -->`: a bash block whose `gppo` commands are run with FLAGS appended
  (later flags win), to fit the test's time; the docs say what the command takes as written.

Blocks tagged `python` run as written, the blocks of one file in order in one namespace (as a
reader would paste them), in a fresh interpreter so that what they register stays out of the
test process. Blocks tagged `bash`/`sh`/`shell` are `gppo ...` command lines, run in-process
through `gppo.cli.main` in a scratch directory; any other command in an unmarked block fails the
test. Untagged fences are text (output, listings) and must not hold commands. Blocks of other
languages (toml, yaml) are configuration text.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gppo.cli import main
from gppo.commands import COMMANDS
from gppo.models.loading import NAMED_MODELS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(not run|run with):\s*(.*?)\s*-->")
SHELL = ("bash", "sh", "shell")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: tuple[str, str] | None  # ("not run", reason) or ("run with", flags)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence"
        marker = MARKER.search(lines[i - 1]) if i else None
        found.append(
            Block(
                path,
                i + 1,
                fence.group(2).lower(),
                "\n".join(lines[i + 1 : end]) + "\n",
                (marker.group(1), marker.group(2)) if marker else None,
            )
        )
        i = end + 1
    return found


def commands(block: Block) -> list[list[str]]:
    """The command lines of a shell block as argv lists (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


ALL = [block for path in DOCS for block in blocks(path)]
SHELL_BLOCKS = [b for b in ALL if b.language in SHELL]


def test_every_block_is_run_or_marked_and_every_marker_says_why():
    assert len(ALL) > 10, "no code blocks found: did the docs move?"
    for block in ALL:
        if block.marker:
            assert block.marker[1], f"{block.where}: a marker needs its reason or flags"
            assert block.language in (*SHELL, "python"), (
                f"{block.where}: a marker on a {block.language or 'text'} block"
            )
        if not block.language:  # text: output or a listing, never a command to type
            first = block.text.lstrip().split("\n", 1)[0]
            assert not re.match(r"(\$ |gppo |python |pip |bash )", first), (
                f"{block.where}: a command in an untagged block"
            )
        if block.language in SHELL and (block.marker or ("",))[0] != "not run":
            for argv in commands(block):
                assert argv[0] == "gppo" and argv[1] in COMMANDS, (
                    f"{block.where}: `{' '.join(argv)}` is not a gppo command the test can run: mark the block "
                    "<!-- not run: REASON -->"
                )


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_every_gppo_command_of_the_docs_parses(block):
    for argv in commands(block):
        if argv[0] != "gppo":
            continue
        assert argv[1] in COMMANDS, f"{block.where}: unknown command {argv[1]!r}"
        try:
            importlib.import_module(f"gppo.commands.{argv[1]}").parser().parse(argv[2:])
        except SystemExit as done:  # --help
            assert done.code == 0, f"{block.where}: `{' '.join(argv)}`"


RUN_SHELL = [b for b in SHELL_BLOCKS if (b.marker or ("",))[0] != "not run"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory per docs file, shared by its blocks in order, as a reader's shell would be:
    `gppo eval --model runs/addition-gppo-s0/final` finds what the `gppo train` above it wrote."""
    dirs: dict[Path, Path] = {}
    return lambda path: dirs.setdefault(path, tmp_path_factory.mktemp(path.stem))


@pytest.mark.parametrize("block", RUN_SHELL, ids=lambda b: b.where)
def test_shell_blocks_run(block, scratch, monkeypatch):
    monkeypatch.chdir(scratch(block.path))
    extra = shlex.split(block.marker[1], comments=True) if block.marker else []
    for argv in commands(block):
        if "smollm2" in argv and any(
            importlib.util.find_spec(name) is None for name in NAMED_MODELS["smollm2"].requires
        ):
            pytest.skip(f"needs `{NAMED_MODELS['smollm2'].install}`")
        assert main([*argv[1:], *extra]) == 0, f"{block.where}: `{' '.join(argv)}` failed"


PYTHON_FILES = sorted({b.path for b in ALL if b.language == "python" and not b.marker})


def test_python_blocks_run_as_written(tmp_path):
    """Every file's python blocks in order in one namespace per file, all files in one fresh
    interpreter (one torch import), in a scratch directory."""
    script = ""
    for path in PYTHON_FILES:
        runnable = [b for b in blocks(path) if b.language == "python" and not b.marker]
        script += "ns = {'__name__': '__main__'}\n" + "".join(
            f"exec(compile({b.text!r}, {b.where!r}, 'exec'), ns)\n" for b in runnable
        )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(PYTHON_FILES) >= 4  # README.md, extending.md, library.md, benchmarks.md at least
    assert ROOT / "README.md" in PYTHON_FILES, "the README's library example is no longer an unmarked python block"
