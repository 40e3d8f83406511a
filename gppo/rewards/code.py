"""Run untrusted Python programs against tests in a sandboxed subprocess.

Every test case runs in a fresh `python -I -B` process (`_code_runner.py` run as a script;
isolated mode: no user site-packages, no PYTHON* variables, neither the script directory nor the
current one on sys.path), started in a new private temporary directory that is deleted
afterwards. That process is a trusted bootstrap: it isolates itself, forks the program process,
enforces the wall clock, and kills and reaps every process the program left behind. Layers,
strongest first:

- Namespaces, where the kernel permits them (as root, or as any user where unprivileged user
  namespaces are allowed): a new network namespace (only a loopback that is down: no network at
  all), a mount namespace with empty private tmpfs on /tmp (the working directory), /var/tmp and
  /dev/shm, whose contents vanish with the program, a PID namespace, so every process the
  program started is killed when it ends, and its own /proc (where the kernel allows mounting
  one), in which neither the caller nor the bootstrap appears.
- No root: a program started as root runs as `nobody` (65534), because RLIMIT_NPROC never binds
  root (no fork-bomb protection) and root may write anywhere. Interpreter directories `nobody`
  cannot enter (e.g. a pyenv under /root) are bind-mounted back in place under an empty tmpfs
  laid over the closed directory, which needs the mount namespace; without it, root stays root
  when its interpreter is out of `nobody`'s reach, and only the wall clock stops a fork bomb.
- `resource` limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE (bounds stdout and every
  file written), RLIMIT_NOFILE, no core files; the wall clock is enforced by the bootstrap and, as
  a backstop, by the caller, which kills the whole process group (`start_new_session=True`).
- Always, a Python audit hook in the program's interpreter refuses creating sockets and resolving
  host names, starting processes or executables, importing ctypes or other modules that reach
  native code or processes unaudited, signalling processes, creating symbolic links, anything
  under /proc, writing, renaming or deleting files outside the working directory, and every way
  to the interpreter's frames, objects and control flow that it can see: `sys._getframe` (with
  the ValueError the standard library expects where frames are missing, so namedtuple, Enum and
  logging still work), traceback, generator and coroutine frames, `sys._current_frames`, the
  garbage collector's object lists, tracing and profiling, new audit hooks, and replacing the
  code of the harness's functions.

Fallback: where namespaces are refused, that audit hook is the only network barrier. It is a
guard against accidents, not a security boundary (a program with its own native code could get
around it), and processes that leave the program's process group (setsid) can outlive it.

Proof that the test ran to its end (reward hacking). A program that ends early (`sys.exit(0)`,
`os._exit(0)`, a signal, a crash, killing its parent), or vouches for itself, must score 0. The
caller draws two random 16-byte tokens, `passed` and `failed`, and sends them with the test
through a descriptor that the bootstrap reads and closes before the program process exists; no
file of the harness has a name (stdin, stdout, the test, the tokens and the results are unlinked
temporary files). In the program process the main thread keeps the tokens in its local variables
and never runs program code; a worker thread runs the program and then its test, and stops on
the last line of its function, which it reaches only when the program and the test returned
without an exception (call tests: the function returned a value; stdin/stdout tests: the program
finished or called `sys.exit(0)`, then its threads finished). The main thread wakes, reads that
frame's current line, and writes `payload, length, token` to the result file: the `passed` token
only if the worker stands on that line. The caller accepts exactly that framing with one of its
tokens; anything else (nothing written, other bytes before or after) is a runtime error. So a
program that ends early leaves no token; one that writes to descriptors 3..255 cannot write a
token it does not know, and spoils its own record; `atexit` handlers never run (the main thread
ends with `os._exit`); killing the caller or the bootstrap is refused (and the caller's and the
bootstrap's process are not in the program's PID namespace). Assert tests run in a fresh
namespace with the program's names but with builtins and prelude names as they were before the
program ran (shadowing or patching `builtins.abs`, `__import__`, `AssertionError` or `check`
reaches only the program's own code); the program's functions are wrapped so that what they
return must be plain data (built-in types, or classes loaded before the program ran, checked
through lists, tuples, sets, dicts, deques, instance attributes and iterators), since an object
of the program's own class could answer `==`, `-` or `bool()` as it likes; and the test fails if
the program rebound an attribute of a module loaded before it ran (`math.isclose`), changed a
class from such a module (`Counter.__eq__`) or replaced a module in `sys.modules`. Stdin/stdout
outputs and call results are compared in the caller, out of reach.

Threat model and its limits. The design holds against programs that stay within Python as the
audit hook leaves it to them, on CPython 3.10-3.12 (there a frame's line cannot be moved but by
a tracing function, and a frame's locals cannot be written from outside). It does not hold
against native code, which could read the tokens from memory: CPython does not check bytecode (a
hand-made code object, from `marshal` or `CodeType`), ctypes' pointer types read memory without
an audit event (so ctypes is refused; numpy imports without it), and an interpreter bug would
do. Within Python, an assert-style test necessarily runs inside the
program's interpreter: a program could find the test's expected values through a route the hook
misses; the check on returned values does not look inside objects of trusted classes other than
the containers above (a numpy object array, a `slice`), nor at methods of the program's classes
(`Solution().f()`), nor at arguments the program mutates in place; it rejects the program's own
namedtuple, dataclass and Enum objects and classes from modules the program imported itself
(`Fraction`); and a patch that the program undoes before the test ends (from another thread, a
finalizer) is not seen. Programs that rely on `signal.signal` fail (it needs the main thread),
and one that ends with `os._exit(0)` after printing the right answer fails too. Run untrusted
code in a container or VM if more is at stake.

Outputs of stdin/stdout tests are compared token by token (any run of whitespace separates
tokens, so trailing spaces and newlines do not matter); two numeric tokens also match when they
are equal as decimals or, if either has a fraction or exponent, within 1e-6 (absolute or
relative). Problems needing a special checker (several valid answers) are not supported.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any, Sequence, Union


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


CodeTest = Union[StdioTest, CallTest, AssertTest]


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
    """The outcome of one test case; `isolation` is "namespaces" or "guard" (see module doc)."""

    status: CaseStatus
    detail: str = ""
    elapsed_s: float = 0.0
    isolation: str = ""


@dataclass(frozen=True)
class Limits:
    """Per-test-case limits. `timeout_s` bounds wall-clock time and, rounded up, CPU seconds;
    `memory_mb` is address space (RLIMIT_AS); `max_processes` (RLIMIT_NPROC) counts the processes
    and threads of the user the program runs as, so programs running at the same time share it
    (each holds two: the harness's thread and the one running the program)."""

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
                raise ValueError(f"test {i}: stdin tests need string input and output, got "
                                 f"{type(inp).__name__} and {type(out).__name__}")
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
_NOBODY = 65534
_GRACE_S = 5.0  # the caller's backstop beyond the bootstrap's own wall clock
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        # numeric libraries would otherwise start a thread per core, against RLIMIT_NPROC
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_TOKEN_BYTES = 16


def run_test(code: str, test: CodeTest, limits: Limits = Limits()) -> CaseResult:
    """Run `code` on one test case in a fresh sandboxed process and judge the outcome."""
    workdir = tempfile.mkdtemp(prefix="gppo-sandbox-")
    try:
        if os.geteuid() == 0:
            os.chown(workdir, _NOBODY, _NOBODY)  # writable by the program once it drops root
        tokens = secrets.token_bytes(_TOKEN_BYTES), secrets.token_bytes(_TOKEN_BYTES)
        config = {"source": code, "timeout_s": limits.timeout_s, "memory_mb": limits.memory_mb,
                  "max_output_bytes": limits.max_output_bytes, "max_processes": limits.max_processes,
                  "max_open_files": limits.max_open_files,
                  "passed_token": tokens[0].hex(), "failed_token": tokens[1].hex()}
        if isinstance(test, CallTest):
            config.update(kind="call", fn_name=test.fn_name, args=test.args)
        elif isinstance(test, AssertTest):
            config.update(kind="assert", test_code=test.code)
        else:
            config.update(kind="stdio")
        # No file has a name: the program finds neither its test nor the tokens on disk.
        files = {name: tempfile.TemporaryFile(dir=workdir)
                 for name in ("stdin", "stdout", "stderr", "status", "config", "done")}
        try:
            config["done_fd"] = files["done"].fileno()
            os.fchmod(files["stdin"].fileno(), 0o644)  # the program may reopen it (/dev/stdin)
            if isinstance(test, StdioTest):
                files["stdin"].write(test.input.encode())
                files["stdin"].seek(0)
            files["config"].write(json.dumps(config).encode())
            files["config"].seek(0)
            fds = (files["config"].fileno(), files["status"].fileno(), config["done_fd"])
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", _RUNNER, str(fds[0]), str(fds[1])],
                stdin=files["stdin"], stdout=files["stdout"], stderr=files["stderr"],
                pass_fds=fds, cwd=workdir, env={**_ENV, "HOME": workdir}, start_new_session=True,
            )
            try:
                proc.wait(timeout=limits.timeout_s + _GRACE_S)
                killed = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
            elapsed = time.monotonic() - start
            return _judge(test, files, tokens, limits, killed, elapsed)
        finally:
            for f in files.values():
                f.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_tests(code: str, tests: Sequence[CodeTest], limits: Limits = Limits(),
              fail_fast: bool = False) -> list[CaseResult]:
    """Run the tests one after another; with `fail_fast`, stop after the first failure."""
    results = []
    for test in tests:
        results.append(run_test(code, test, limits))
        if fail_fast and results[-1].status is not CaseStatus.PASSED:
            break
    return results


def run_many(jobs: Sequence[tuple[str, Sequence[CodeTest]]], limits: Limits = Limits(),
             max_workers: int | None = None, fail_fast: bool = False) -> list[list[CaseResult]]:
    """Run `(code, tests)` jobs on a pool of `max_workers` threads (default: CPU count), each
    thread running one sandboxed process at a time; results come back in job order."""
    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits, fail_fast), jobs))


def score_code(completions: Sequence[str], tests: Sequence[Sequence[CodeTest]],
               limits: Limits = Limits(), all_or_nothing: bool = True,
               max_workers: int | None = None) -> list[CodeResult]:
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


def _judge(test: CodeTest, files: dict, tokens: tuple[bytes, bytes], limits: Limits,
           killed: bool, elapsed: float) -> CaseResult:
    files["status"].seek(0)
    info: dict = {}
    for line in files["status"].read().splitlines():  # written by the sandbox only
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
    exit_info = info.get("exit")
    if killed or (exit_info and exit_info["timed_out"]):
        return result(CaseStatus.TIMEOUT, f"wall-clock limit of {limits.timeout_s:g} s")
    if stdout_size > limits.max_output_bytes:
        return result(CaseStatus.OUTPUT_LIMIT, f"more than {limits.max_output_bytes} bytes of output")
    if exit_info is None or "setup" not in info:  # the sandbox failed before the program ran
        raise SandboxError(f"the sandbox could not start the program: {stderr_tail()}")
    files["done"].seek(0)
    passed, payload = _verdict(files["done"].read(limits.max_output_bytes + 1), tokens)
    if passed is None:
        if exit_info["code"] in (-signal.SIGKILL, -signal.SIGXCPU):
            return result(CaseStatus.TIMEOUT, f"CPU time limit of {math.ceil(limits.timeout_s)} s")
        return result(CaseStatus.RUNTIME_ERROR,
                      f"the program ended before its test finished (exit status {exit_info['code']}): "
                      f"{stderr_tail()[-300:]}")
    if not passed:
        try:
            failure = json.loads(payload)
            error, message = str(failure["error"]), str(failure["message"])
        except (ValueError, TypeError, KeyError):
            error, message = "unknown", "the program failed"
        if error == "MemoryError":
            return result(CaseStatus.MEMORY, f"memory limit of {limits.memory_mb} MB")
        failed_assert = isinstance(test, AssertTest) and error == "AssertionError"
        status = CaseStatus.WRONG_ANSWER if failed_assert else CaseStatus.RUNTIME_ERROR
        return result(status, f"{error}: {message}")
    if isinstance(test, StdioTest):
        files["stdout"].seek(0)
        got = files["stdout"].read(limits.max_output_bytes).decode(errors="replace")
        if _same_stdout(got, test.output):
            return result(CaseStatus.PASSED)
        return result(CaseStatus.WRONG_ANSWER, f"expected {test.output[:100]!r}, got {got[:100]!r}")
    if isinstance(test, CallTest):
        try:
            value = json.loads(payload)
        except ValueError:
            return result(CaseStatus.RUNTIME_ERROR, "the returned value could not be read")
        if _same_value(value, test.expected):
            return result(CaseStatus.PASSED)
        return result(CaseStatus.WRONG_ANSWER,
                      f"expected {str(test.expected)[:100]}, got {str(value)[:100]}")
    return result(CaseStatus.PASSED)


def _verdict(data: bytes, tokens: tuple[bytes, bytes]) -> tuple[bool | None, bytes]:
    """Read `payload, len(payload) as 8 bytes, token`, the harness's last word: whether the test
    ran to its end (the `passed` token), did not (`failed`), or None when the record is missing
    or malformed (the program ended first, or wrote to the descriptor itself)."""
    n = _TOKEN_BYTES
    if len(data) < n + 8 or data[-n:] not in tokens:
        return None, b""
    size = int.from_bytes(data[-n - 8:-n], "big")
    if len(data) != size + n + 8:
        return None, b""
    return data[-n:] == tokens[0], data[:size]


def _same_stdout(got: str, expected: str) -> bool:
    a, b = got.split(), expected.split()
    return len(a) == len(b) and all(x == y or _same_number(x, y) for x, y in zip(a, b))


def _same_number(a: str, b: str) -> bool:
    try:
        x, y = Decimal(a), Decimal(b)
    except InvalidOperation:
        return False
    if not (x.is_finite() and y.is_finite()):
        return False
    if x == y:
        return True
    if not any(c in s for s in (a, b) for c in ".eE"):
        return False
    return abs(x - y) <= Decimal("1e-6") * max(Decimal(1), abs(y))


def _same_value(got: Any, expected: Any) -> bool:
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(_same_value, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_same_value(got[k], expected[k]) for k in got)
    numbers = (int, float)
    if (isinstance(got, numbers) and isinstance(expected, numbers) and
            not isinstance(got, bool) and not isinstance(expected, bool) and
            (isinstance(got, float) or isinstance(expected, float))):
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
    return got == expected
