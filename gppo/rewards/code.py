"""Run untrusted Python programs against tests in a sandbox; judge them outside its reach.

Each test case runs in a fresh process, started by a trusted bootstrap (`_code_runner.py`) in a
private root: the Python runtime read-only and an empty working directory, no network, its own
process IDs, resource limits, not root (bubblewrap where installed, else namespaces set up by
the bootstrap; without namespaces, on the host's filesystem). That process (`_code_child.py`)
gets the program and the test's inputs only; outputs cross back as plain data by value
(`_wire.py`) and are compared here, and assert-style tests run in the bootstrap, calling the
program through that boundary. The design, what each layer stops and its limits (the threat
model): docs/sandbox.md.

Outputs of stdin/stdout tests are compared token by token (any run of whitespace separates
tokens, so trailing spaces and newlines do not matter); two numeric tokens also match when they
are equal as decimals or, if the expected token is a float (has a fraction or exponent), within
1e-6 (absolute or relative): see `_same_number`. Call results: see `_same_value`. Problems
needing a special checker (several valid answers) are not supported.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import json
import math
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
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Context, Decimal, InvalidOperation, localcontext
from enum import Enum
from typing import Any

from gppo.rewards import _wire


@dataclass(frozen=True)
class StdioTest:
    """Feed `input` on stdin; stdout must match `output` token by token."""

    input: str
    output: str


@dataclass(frozen=True)
class CallTest:
    """Call `fn_name(*args)` (a top-level function or a method of `class Solution`)."""

    fn_name: str
    args: list
    expected: Any


@dataclass(frozen=True)
class AssertTest:
    """Run `code` (e.g. `assert f(1) == 2`) after the program; it passes if nothing is raised."""

    code: str


CodeTest = StdioTest | CallTest | AssertTest


class CaseStatus(str, Enum):
    """The outcome of one test case."""

    PASSED = "passed"
    WRONG_ANSWER = "wrong_answer"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one test case; `isolation` is "bwrap", "namespaces" or "guard" (see
    docs/sandbox.md)."""

    status: CaseStatus
    detail: str = ""
    elapsed_s: float = 0.0
    isolation: str = ""


@dataclass(frozen=True)
class Limits:
    """Per-test-case limits. `timeout_s` bounds wall-clock time and, rounded up, CPU seconds;
    `memory_mb` is address space (RLIMIT_AS); `max_processes` (RLIMIT_NPROC) counts the processes
    and threads of the user the program runs as (its main thread is one): as root, each program
    running at the same time runs as a uid of its own, so none can use up another's
    (docs/sandbox.md, "Processes")."""

    timeout_s: float = 6.0
    memory_mb: int = 1024
    max_output_bytes: int = 4 << 20
    max_processes: int = 64
    max_open_files: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")


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


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program under test)."""


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
_START_S = 30.0  # for a pool's server to make its namespaces and start
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
    return _sandboxed(code, test, limits, _judge)


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
    it printed (a code interpreter's output: `gppo.rollout.tools`). `ProgramPool` runs it the same
    way at a fraction of the fixed cost."""
    return _sandboxed(code, StdioTest("", ""), limits, _program_output)


def _program_output(test: StdioTest, files: dict, limits: Limits, killed: bool, elapsed: float) -> ProgramRun:
    """`_judge` against an empty expected output (any output counts as a normal exit), and the output."""
    verdict = _judge(test, files, limits, killed, elapsed)
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


class ProgramPool:
    """Runs programs as `run_program` does, with the same isolation, at a fixed cost of a few
    milliseconds instead of two interpreters' start-up (docs/sandbox.md, "The pool").

    `workers` servers, one per slot, each started once in namespaces of its own (PID, mount,
    network, IPC with System V IPC and message queues switched off, UTS) and a private root with a
    read-only /proc, as a fresh interpreter; a call forks the program's process there, as its slot's
    uid (as root), with the limits and the audit hook, and after it every other process of the
    namespace is killed and the writable directories are emptied.
    `run` is thread-safe: up to `workers` calls run at once; more wait for a free slot. Where a
    server cannot run programs (no namespaces here), its calls fall back to `run_program`, with a
    warning. Close it (`close`, or use it as a context manager) to end the servers; a pool does not
    survive `fork`."""

    def __init__(self, workers: int = 4):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"ProgramPool: workers must be a positive int, got {workers!r}")
        self._directory = tempfile.mkdtemp(prefix="gppo-pool-")  # the servers' mount point: stays empty
        self._changed = threading.Condition()
        self._free: list[_Server | None] = []  # None: a slot whose calls go to run_program
        self._size = self._fallen = 0  # slots, and those whose server failed
        self._closed = self._warned = False
        try:
            for _ in range(workers):
                self._free.append(self._start_server())
                self._size += 1
        except BaseException:
            self.close()
            raise

    @property
    def servers(self) -> int:
        """How many slots have a server (the others' calls go to `run_program`)."""
        return self._size - self._fallen

    def run(self, code: str, limits: Limits = Limits()) -> ProgramRun:
        """`run_program(code, limits)`, in a free slot (waiting for one)."""
        with self._changed:
            self._changed.wait_for(lambda: self._free or self._closed)
            if self._closed:
                raise RuntimeError("ProgramPool.run: the pool is closed")
            server = self._free.pop()
        try:
            if server is not None:
                try:
                    return self._run_in(server, code, limits)
                except (OSError, SandboxError) as error:  # the server failed, not the program: run it again
                    server.close()
                    server = None
                    self._fall_back(error)
            return run_program(code, limits)
        finally:
            with self._changed:
                self._free.append(server)
                self._changed.notify_all()

    def close(self) -> None:
        """Wait for the calls running, then end the servers; later calls raise."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: len(self._free) == self._size)
            servers, self._free, self._size = self._free, [], 0
        for server in servers:
            if server is not None:
                server.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ProgramPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_server(self) -> _Server | None:
        try:
            if os.geteuid() != 0:
                raise OSError(
                    "not root: in a user namespace a forked program would keep the capabilities that made it "
                    "(only an exec drops them); run as root for the pool"
                )
            return _Server(self._directory)
        except OSError as error:
            self._fall_back(error)
            return None

    def _fall_back(self, error: BaseException) -> None:
        with self._changed:
            self._fallen += 1
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(
                f"ProgramPool: a sandbox server could not run programs ({str(error)[:300]}); its calls run "
                "with run_program instead",
                RuntimeWarning,
                stacklevel=3,
            )

    def _run_in(self, server: _Server, code: str, limits: Limits) -> ProgramRun:
        test = StdioTest("", "")
        with _call_files({"source": code}, test, self._directory) as files:  # the server never reads it
            start = time.monotonic()
            server.call(files, limits)
            return _program_output(test, files, limits, False, time.monotonic() - start)


class _Server:
    """One slot of a `ProgramPool`: a server (started by `_code_runner.py serve`, running
    `_code_server.py` in its own namespaces) on one end of a socket, and the uid its programs run as
    (as root; held while the server lives). `OSError` when it cannot start."""

    def __init__(self, directory: str):
        self._held = contextlib.ExitStack()
        self.uid = self._held.enter_context(_program_uid())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = self._held.enter_context(ours)
        self._errors = self._held.enter_context(tempfile.TemporaryFile())  # why it could not start
        config = json.dumps({"uid": self.uid, "env": _ENV, **_runtime()})
        with theirs:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-S", _RUNNER, "serve", str(theirs.fileno()), config],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=self._errors,
                    pass_fds=(theirs.fileno(),),
                    cwd=directory,
                    env=_ENV,
                    start_new_session=True,
                )
            except BaseException:
                self._held.close()
                raise
        self._socket.settimeout(_START_S)
        try:
            started = self._socket.recv(16) == b"ready"
        except OSError:
            started = False
        if not started:
            self._errors.seek(0)
            errors = self._errors.read()[-300:].decode(errors="replace").strip()
            self.close()
            raise OSError(f"the sandbox server did not start: {errors or 'no answer'}")

    def call(self, files: dict, limits: Limits) -> None:
        """Run the call the files describe (the server writes its outcome to the status file)."""
        fds = [files[name].fileno() for name in ("config", "status", "stdin", "stdout", "stderr")]
        socket.send_fds(self._socket, [json.dumps(dataclasses.asdict(limits)).encode()], fds)
        self._socket.settimeout(limits.timeout_s + _GRACE_S)  # past the server's own wall clock: it is stuck
        if not self._socket.recv(16):
            raise OSError(f"the sandbox server ended (exit status {self._process.poll()})")

    def close(self) -> None:
        self._socket.close()  # the server reads the end of its socket and exits
        try:
            self._process.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._held.close()


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


def _judge(test: CodeTest, files: dict, limits: Limits, killed: bool, elapsed: float) -> CaseResult:
    """The verdict, from what only the bootstrap writes (the status file) and the program's output."""
    files["status"].seek(0)
    info: dict = {}
    for line in files["status"].read().splitlines():
        try:
            info.update(json.loads(line))
        except ValueError:
            pass  # cut short: the backstop killed the bootstrap while it wrote
    isolation = info.get("setup", {}).get("isolation", "")

    def result(status: CaseStatus, detail: str = "") -> CaseResult:
        return CaseResult(status, detail[:300], round(elapsed, 3), isolation)

    def stderr_tail() -> str:
        files["stderr"].seek(0)
        return files["stderr"].read()[-2000:].decode(errors="replace")

    stdout_size = os.fstat(files["stdout"].fileno()).st_size
    exit_info, outcome = info.get("exit"), info.get("outcome")
    if killed or (exit_info and exit_info["timed_out"]):
        return result(CaseStatus.TIMEOUT, f"wall-clock limit of {limits.timeout_s:g} s")
    if stdout_size > limits.max_output_bytes:
        return result(CaseStatus.OUTPUT_LIMIT, f"more than {limits.max_output_bytes} bytes of output")
    if exit_info is None or "setup" not in info:  # the sandbox failed before the program ran
        raise SandboxError(f"the sandbox could not start the program: {stderr_tail()}")
    if isinstance(test, StdioTest):
        if exit_info["code"] != 0:
            return _failure(result, "", stderr_tail(), exit_info["code"], limits)
        files["stdout"].seek(0)
        got = files["stdout"].read(limits.max_output_bytes).decode(errors="replace")
        if _same_stdout(got, test.output):
            return result(CaseStatus.PASSED)
        return result(CaseStatus.WRONG_ANSWER, f"expected {test.output[:100]!r}, got {got[:100]!r}")
    if not isinstance(outcome, dict) or "error" in outcome:
        error = outcome if isinstance(outcome, dict) else {}
        message = f"{error.get('error', 'ProgramFailure')}: {error.get('message', 'no outcome')}"
        if isinstance(test, AssertTest) and error.get("error") == "AssertionError":
            return result(CaseStatus.WRONG_ANSWER, message)
        return _failure(result, message, stderr_tail(), exit_info["code"], limits)
    if isinstance(test, AssertTest):
        return result(CaseStatus.PASSED) if outcome.get("passed") is True else result(CaseStatus.RUNTIME_ERROR)
    try:
        value = _wire.untag(outcome.get("value"))
    except _wire.NotPlain as e:
        return result(CaseStatus.RUNTIME_ERROR, f"the returned value could not be read: {e}")
    if _same_value(value, test.expected):
        return result(CaseStatus.PASSED)
    return result(CaseStatus.WRONG_ANSWER, f"expected {str(test.expected)[:100]}, got {str(value)[:100]}")


def _failure(result, message: str, stderr: str, exit_code: int, limits: Limits) -> CaseResult:
    """A program that failed: out of memory, out of CPU time, or any other error."""
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    if message.startswith("MemoryError") or last_line.startswith("MemoryError"):
        return result(CaseStatus.MEMORY, f"memory limit of {limits.memory_mb} MB")
    if exit_code in (-signal.SIGKILL, -signal.SIGXCPU):
        return result(CaseStatus.TIMEOUT, f"CPU time limit of {math.ceil(limits.timeout_s)} s")
    return result(CaseStatus.RUNTIME_ERROR, message or f"exit status {exit_code}: {stderr[-300:]}")


def _same_stdout(got: str, expected: str) -> bool:
    a, b = got.split(), expected.split()
    return len(a) == len(b) and all(x == y or _same_number(x, y) for x, y in zip(a, b))


_UNTRAPPED = Context(traps=[])


def _same_number(got: str, expected: str) -> bool:
    """Two numeric tokens match when equal as decimals, exactly (`2.0` or `2e0` for an expected `2`,
    as Python's `2.0 == 2`), or within 1e-6 (absolute or relative) when the expected token is a
    float (has a fraction or exponent). An expected integer takes no tolerance: `1000404.0` fails
    for `1000405`."""
    try:
        x, y = Decimal(got), Decimal(expected)
    except InvalidOperation:
        return False
    if not (x.is_finite() and y.is_finite()):
        return False
    if x == y:
        return True
    if not any(c in expected for c in ".eE"):
        return False
    with localcontext(_UNTRAPPED):  # a printed 1e9999999 overflows to infinity rather than raising
        return abs(x - y) <= Decimal("1e-6") * max(Decimal(1), abs(y))


def _same_value(got: Any, expected: Any) -> bool:
    """A call's result (plain data, decoded here) against the expected value: a bool equals only
    a bool; an expected int equals only the same number, exactly (an int, or a float such as
    2.0 for 2); an expected float matches an int or float within 1e-6 (absolute or relative); a
    list or tuple matches a list or tuple item by item; dict keys compare as JSON writes them
    (`1` matches `"1"`); anything else only with the same type and `==`."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is bool and type(expected) is bool and got == expected
    if type(got) in (int, float) and type(expected) in (int, float):
        if type(expected) is int:
            return got == expected  # exact, also for a float (Python compares int and float exactly)
        try:
            return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
        except OverflowError:  # an int too large for a float
            return False
    if isinstance(expected, (list, tuple)):
        return type(got) in (list, tuple) and len(got) == len(expected) and all(map(_same_value, got, expected))
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return False
        got_keys = {_json_key(k): k for k in got}
        expected_keys = {_json_key(k): k for k in expected}
        return (
            len(got_keys) == len(got)
            and got_keys.keys() == expected_keys.keys()
            and all(_same_value(got[got_keys[k]], expected[expected_keys[k]]) for k in got_keys)
        )
    return type(got) is type(expected) and got == expected


def _json_key(key: Any) -> Any:
    return key if type(key) is str else json.dumps(key) if type(key) in (bool, int, float, type(None)) else key
