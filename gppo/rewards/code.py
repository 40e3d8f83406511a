"""Run untrusted Python programs against tests in a sandbox; judge them outside its reach.

Each test case runs in a fresh process, started by a trusted bootstrap (`_code_runner.py`) in a
private root: the Python runtime read-only and an empty working directory, no network, its own
process IDs, resource limits, not root (bubblewrap where installed, else namespaces set up by
the bootstrap; without namespaces, on the host's filesystem). That process (`_code_child.py`)
gets the program and the test's inputs only; outputs cross back as plain data by value
(`_wire.py`) and are judged in this process, and assert-style tests run in the bootstrap, calling
the program through that boundary. The design, what each layer stops and its limits (the threat
model): docs/sandbox.md.

Here: running programs and scoring completions. The test cases, `Limits`, the outcomes and the
verdict (`judge` and the output comparisons) are `verdicts.py`'s, imported here for callers;
`ProgramPool`, which runs programs as `run_program` does on pre-started servers, is `pool.py`'s.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import json
import os
import pwd
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gppo.rewards.verdicts import (
    AssertTest,
    CallTest,
    CaseResult,
    CaseStatus,
    CodeTest,
    Limits,
    SandboxError,
    StdioTest,
    judge,
)


@dataclass
class CodeResult:
    """Score of one completion: `reward` in [0, 1]; `error` says why nothing ran (no/invalid code)."""

    code: str | None
    cases: list[CaseResult]
    n_tests: int
    reward: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        """All tests passed."""
        passed = sum(c.status is CaseStatus.PASSED for c in self.cases)
        return self.n_tests > 0 and passed == self.n_tests


# ---------------------------------------------------------------------------------------------
# Test construction and code extraction


def io_tests(inputs: Sequence, outputs: Sequence, fn_name: str | None = None) -> list[CodeTest]:
    """Tests from parallel input/output lists (APPS/TACO, LiveCodeBench, Skywork-OR1 layout).

    Without `fn_name` they are stdin/stdout strings. With it they are calls: an input is either a
    list of arguments or a string holding one JSON argument per line (LiveCodeBench), an output
    either the value or its JSON text.
    """
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs: they must pair up")
    if not inputs:
        raise ValueError("no test cases: 'inputs' and 'outputs' are empty")
    tests: list[CodeTest] = []
    for i, (inp, out) in enumerate(zip(inputs, outputs)):
        if fn_name is None:
            if not isinstance(inp, str) or not isinstance(out, str):
                raise ValueError(
                    f"test {i}: stdin tests need string input and output, got "
                    f"{type(inp).__name__} and {type(out).__name__}"
                )
            tests.append(StdioTest(inp, out))
            continue
        try:
            args = [json.loads(line) for line in inp.split("\n")] if isinstance(inp, str) else inp
            expected = json.loads(out) if isinstance(out, str) else out
        except json.JSONDecodeError as e:
            raise ValueError(f"test {i}: call arguments and results must be JSON ({e})") from None
        if not isinstance(args, list):
            raise ValueError(f"test {i}: call arguments must be a list, got {type(args).__name__}")
        tests.append(CallTest(fn_name, args, expected))
    return tests


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The program in a completion, or None.

    Only the text after the last `</think>` is searched when there is one. Order: the last
    ```python (or py, python3) fenced block; else the last fenced block of any language; else
    the text after an unclosed ```python fence (a truncated answer); else the whole text if it
    parses as Python.
    """
    text = completion.rsplit("</think>", 1)[-1]
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [body for _, body in blocks])[-1]
    opened = re.search(r"```(?:python|py|python3)[^\n]*\n(.*)\Z", text, re.DOTALL | re.IGNORECASE)
    if opened:
        return opened.group(1)
    if text.strip():
        try:
            ast.parse(text)
            return text
        except (SyntaxError, ValueError):
            pass
    return None


# ---------------------------------------------------------------------------------------------
# Running (caller side)

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_runner.py")
# As root, each program runs as a uid of its own among these (below systemd's dynamic users, above
# Debian's and Ubuntu's regular ones, inside the 65536 uids a container's user namespace maps).
_PROGRAM_UIDS = range(60000, 61024)
_GRACE_S = 5.0  # the caller's backstop beyond the bootstrap's own wall clock
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # numeric libraries would otherwise start a thread per core, against RLIMIT_NPROC
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@functools.cache
def _isolation() -> tuple[str, str | None]:
    """("bwrap", its path) where bubblewrap is installed and can make namespaces here, else
    ("namespaces", None): the bootstrap sets them up itself, or falls back to "guard"."""
    path = shutil.which("bwrap")
    if path is not None:
        probe = [path, "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--", sys.executable, "-I", "-c", ""]
        try:
            if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                return "bwrap", path
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "namespaces", None


@functools.cache
def _runtime() -> dict:
    """This interpreter's prefixes and site-packages: what the sandbox shows of the host."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return {"prefixes": sorted(prefixes), "site_packages": [p for p in site.getsitepackages() if os.path.isdir(p)]}


def run_test(code: str, test: CodeTest, limits: Limits = Limits()) -> CaseResult:
    """Run `code` on one test case in a fresh sandboxed process and judge the outcome."""
    return _sandboxed(code, test, limits, judge)


@dataclass(frozen=True)
class ProgramRun:
    """A program run as a script: `status` PASSED when it exited normally (whatever it printed),
    else why not (timeout, memory, output limit, runtime error, with `detail`); its stdout (at
    most `Limits.max_output_bytes`), the tail of its stderr, and the isolation it ran in."""

    status: CaseStatus
    stdout: str
    stderr: str
    detail: str = ""
    isolation: str = ""

    @property
    def reason(self) -> str:
        """Why the run failed, in one line of at most 300 characters, apart from its stdout; ""
        when it exited normally. A runtime error's is the last line of its stderr (the
        exception), else its detail; a limit's names it ("timeout: wall-clock limit of 5 s")."""
        if self.status is CaseStatus.PASSED:
            return ""
        if self.status is CaseStatus.RUNTIME_ERROR:
            lines = self.stderr.strip().splitlines()
            reason = lines[-1] if lines else self.detail
        else:
            reason = f"{self.status.value}: {self.detail}"
        return " ".join(reason.split())[:300]


def run_program(code: str, limits: Limits = Limits()) -> ProgramRun:
    """Run `code` as a script with an empty stdin, in the sandbox of `run_test`, and return what
    it printed (a code interpreter's output: `gppo.rollout.tools`). `gppo.rewards.pool.ProgramPool`
    runs it the same way at a fraction of the fixed cost."""
    return _sandboxed(code, StdioTest("", ""), limits, _program_output)


def _program_output(test: StdioTest, files: dict, limits: Limits, killed: bool, elapsed: float) -> ProgramRun:
    """`judge` against an empty expected output (any output counts as a normal exit), and the output."""
    verdict = judge(test, files, limits, killed, elapsed)
    ran = verdict.status in (CaseStatus.PASSED, CaseStatus.WRONG_ANSWER)
    files["stdout"].seek(0)
    files["stderr"].seek(0)
    stdout = files["stdout"].read(limits.max_output_bytes).decode(errors="replace")
    stderr = files["stderr"].read()[-2000:].decode(errors="replace")
    status, detail = (CaseStatus.PASSED, "") if ran else (verdict.status, verdict.detail)
    return ProgramRun(status, stdout, stderr, detail, verdict.isolation)


@contextlib.contextmanager
def _program_uid() -> Iterator[int | None]:
    """As root, a uid from `_PROGRAM_UIDS` that no other program running now has (in any process
    here: each is held as an abstract socket's name, which the kernel frees when its holder ends),
    so that the per-user limits (RLIMIT_NPROC) bound each program alone; else None."""
    if os.geteuid() != 0:
        yield None
        return
    for uid in _PROGRAM_UIDS:
        if not _unknown_uid(uid):
            continue
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(f"\0gppo-sandbox-uid-{uid}")
        except OSError:
            holder.close()
            continue
        with holder:
            yield uid
        return
    raise SandboxError(f"more than {len(_PROGRAM_UIDS)} sandboxed programs at once: no uid is left for another")


@functools.cache
def _unknown_uid(uid: int) -> bool:
    """Whether no account has `uid` (a program must not get an account's files or processes)."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def _config(code: str, test: CodeTest, limits: Limits, uid: int | None) -> dict:
    """What the bootstrap gets: the program, the test's inputs (never an expected output), limits."""
    isolation, bwrap = _isolation()
    config = {
        "source": code,
        **dataclasses.asdict(limits),
        "env": _ENV,
        "isolation": isolation,
        "bwrap": bwrap,
        "uid": uid,
        **_runtime(),
    }
    if isinstance(test, CallTest):  # the inputs only: the expected value stays here
        config.update(kind="call", fn_name=test.fn_name, args=test.args)
    elif isinstance(test, AssertTest):  # run by the bootstrap, never by the program's process
        config.update(kind="assert", test_code=test.code)
    else:
        config.update(kind="stdio")
    return config


@contextlib.contextmanager
def _call_files(config: dict, test: CodeTest, directory: str) -> Iterator[dict]:
    """The call's files, unnamed in `directory` (nothing of the harness is on disk for a program to
    find): its config, stdin, stdout, stderr, and the status only the bootstrap writes."""
    files = {name: tempfile.TemporaryFile(dir=directory) for name in ("stdin", "stdout", "stderr", "status", "config")}
    try:
        os.fchmod(files["stdin"].fileno(), 0o644)  # the program may reopen it (/dev/stdin)
        if isinstance(test, StdioTest):
            files["stdin"].write(test.input.encode())
            files["stdin"].seek(0)
        files["config"].write(json.dumps(config).encode())
        files["config"].seek(0)
        yield files
    finally:
        for f in files.values():
            f.close()


def _sandboxed(code: str, test: CodeTest, limits: Limits, judge):
    """Run `code` for `test` in a fresh sandboxed process; `judge(test, files, limits, killed,
    elapsed)` reads the outcome from the process's files before they are closed."""
    workdir = tempfile.mkdtemp(prefix="gppo-sandbox-")
    try:
        with _program_uid() as uid:
            if uid is not None:
                os.chown(workdir, uid, uid)  # the program's directory where there is no private root
            config = _config(code, test, limits, uid)
            with _call_files(config, test, workdir) as files:
                fds = (files["config"].fileno(), files["status"].fileno())
                start = time.monotonic()
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-S", _RUNNER, str(fds[0]), str(fds[1])],
                    stdin=files["stdin"],
                    stdout=files["stdout"],
                    stderr=files["stderr"],
                    pass_fds=fds,
                    cwd=workdir,
                    env=_ENV,
                    start_new_session=True,
                )
                try:
                    proc.wait(timeout=limits.timeout_s + _GRACE_S)
                    killed = False
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    killed = True
                return judge(test, files, limits, killed, time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_tests(
    code: str, tests: Sequence[CodeTest], limits: Limits = Limits(), fail_fast: bool = False
) -> list[CaseResult]:
    """Run the tests one after another; with `fail_fast`, stop after the first failure."""
    results = []
    for test in tests:
        results.append(run_test(code, test, limits))
        if fail_fast and results[-1].status is not CaseStatus.PASSED:
            break
    return results


def run_many(
    jobs: Sequence[tuple[str, Sequence[CodeTest]]],
    limits: Limits = Limits(),
    max_workers: int | None = None,
    fail_fast: bool = False,
) -> list[list[CaseResult]]:
    """Run `(code, tests)` jobs on a pool of `max_workers` threads (default: CPU count), each
    thread running one sandboxed process at a time; results come back in job order."""
    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits, fail_fast), jobs))


def score_code(
    completions: Sequence[str],
    tests: Sequence[Sequence[CodeTest]],
    limits: Limits = Limits(),
    all_or_nothing: bool = True,
    max_workers: int | None = None,
) -> list[CodeResult]:
    """Score each completion against its tests.

    The reward is 1 if every test passes, else 0 (`all_or_nothing`, the evaluation protocol;
    testing then stops at the first failure), or the fraction of tests passed.
    """
    if len(completions) != len(tests):
        raise ValueError(f"{len(completions)} completions but {len(tests)} test lists")
    for i, t in enumerate(tests):
        if not t:
            raise ValueError(f"completion {i} has no tests: every problem needs at least one")
    codes, errors = [], []
    for completion in completions:
        code = extract_code(completion)
        error = None if code is not None else "no Python code found in the completion"
        if code is not None:
            try:
                ast.parse(code)
            except (SyntaxError, ValueError) as e:
                error = f"the code does not parse: {e}"
        codes.append(code)
        errors.append(error)
    jobs = [(c, t) for c, t, e in zip(codes, tests, errors) if e is None]
    runs = iter(run_many(jobs, limits, max_workers, fail_fast=all_or_nothing))
    results = []
    for code, t, error in zip(codes, tests, errors):
        cases = [] if error else next(runs)
        passed = sum(c.status is CaseStatus.PASSED for c in cases)
        reward = float(passed == len(t)) if all_or_nothing else passed / len(t)
        results.append(CodeResult(code, cases, len(t), reward, error))
    return results
