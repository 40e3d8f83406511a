"""Run untrusted Python programs against tests in a sandboxed subprocess.

Every test case runs in a fresh `python -I -B` process (this file run as a script; isolated mode:
no user site-packages, no PYTHON* variables, neither the script directory nor the current one on
sys.path), started in a new private temporary directory that is deleted afterwards. That process
is a trusted bootstrap: it isolates itself, forks the program, enforces the wall clock, and kills
and reaps every process the program left behind. Layers, strongest first:

- Namespaces, where the kernel permits them (as root, or as any user where unprivileged user
  namespaces are allowed): a new network namespace (only a loopback that is down: no network at
  all), a mount namespace with empty private tmpfs on /tmp (the working directory), /var/tmp and
  /dev/shm, whose contents vanish with the program, and a PID namespace, so every process the
  program started is killed when it ends.
- No root: a program started as root runs as `nobody` (65534), because RLIMIT_NPROC never binds
  root (no fork-bomb protection) and root may write anywhere. Interpreter directories `nobody`
  cannot enter (e.g. a pyenv under /root) are bind-mounted back in place under an empty tmpfs
  laid over the closed directory, which needs the mount namespace; without it, root stays root
  when its interpreter is out of `nobody`'s reach, and only the wall clock stops a fork bomb.
- `resource` limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE (bounds stdout and every
  file written), RLIMIT_NOFILE, no core files; the wall clock is enforced by the bootstrap and, as
  a backstop, by the caller, which kills the whole process group (`start_new_session=True`).
- Always, a Python audit hook in the program's interpreter refuses creating sockets and resolving
  host names, starting processes or executables, loading or calling native code with ctypes,
  signalling processes, and writing, renaming or deleting files outside the working directory.

Fallback: where namespaces are refused, that audit hook is the only network barrier. It is a
guard against accidents, not a security boundary (a program with its own native code could get
around it), and processes that leave the program's process group (setsid) can outlive it.

Outputs of stdin/stdout tests are compared token by token (any run of whitespace separates
tokens, so trailing spaces and newlines do not matter); two numeric tokens also match when they
are equal as decimals or, if either has a fraction or exponent, within 1e-6 (absolute or
relative). Problems needing a special checker (several valid answers) are not supported.
"""

from __future__ import annotations

import ast
import ctypes
import json
import math
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
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
    and threads of the user the program runs as, so programs running at the same time share it."""

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

_NOBODY = 65534
_GRACE_S = 5.0  # the caller's backstop beyond the bootstrap's own wall clock
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        # numeric libraries would otherwise start a thread per core, against RLIMIT_NPROC
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_test(code: str, test: CodeTest, limits: Limits = Limits()) -> CaseResult:
    """Run `code` on one test case in a fresh sandboxed process and judge the outcome."""
    workdir = tempfile.mkdtemp(prefix="gppo-sandbox-")
    try:
        if os.geteuid() == 0:
            os.chown(workdir, _NOBODY, _NOBODY)  # writable by the program once it drops root
        config = {"source": code, "timeout_s": limits.timeout_s, "memory_mb": limits.memory_mb,
                  "max_output_bytes": limits.max_output_bytes, "max_processes": limits.max_processes,
                  "max_open_files": limits.max_open_files}
        if isinstance(test, CallTest):
            config.update(kind="call", fn_name=test.fn_name, args=test.args)
        elif isinstance(test, AssertTest):
            config.update(kind="assert", test_code=test.code)
        else:
            config.update(kind="stdio")
        files = {name: open(os.path.join(workdir, name), "w+b")
                 for name in ("stdin", "stdout", "stderr", "result")}
        try:
            if isinstance(test, StdioTest):
                files["stdin"].write(test.input.encode())
                files["stdin"].seek(0)
            config["result_fd"] = files["result"].fileno()
            with open(os.path.join(workdir, "config.json"), "w") as f:
                json.dump(config, f)
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", os.path.abspath(__file__), "config.json"],
                stdin=files["stdin"], stdout=files["stdout"], stderr=files["stderr"],
                pass_fds=(files["result"].fileno(),), cwd=workdir, env={**_ENV, "HOME": workdir},
                start_new_session=True,
            )
            try:
                proc.wait(timeout=limits.timeout_s + _GRACE_S)
                killed = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
            elapsed = time.monotonic() - start
            return _judge(test, files, limits, killed, elapsed)
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


def _judge(test: CodeTest, files: dict, limits: Limits, killed: bool, elapsed: float) -> CaseResult:
    files["result"].seek(0)
    info: dict = {}
    for line in files["result"].read(limits.max_output_bytes + 1).splitlines():
        try:
            info.update(json.loads(line))
        except (TypeError, ValueError):
            pass  # not a record of ours (the program may write to any descriptor)
    isolation = info.get("setup", {}).get("isolation", "")

    def result(status: CaseStatus, detail: str = "") -> CaseResult:
        return CaseResult(status, detail[:300], round(elapsed, 3), isolation)

    stdout_size = os.fstat(files["stdout"].fileno()).st_size
    exit_info = info.get("exit")
    program = info.get("program", {})
    if killed or (exit_info and exit_info["timed_out"]):
        return result(CaseStatus.TIMEOUT, f"wall-clock limit of {limits.timeout_s:g} s")
    if stdout_size > limits.max_output_bytes:
        return result(CaseStatus.OUTPUT_LIMIT, f"more than {limits.max_output_bytes} bytes of output")
    if exit_info is None or "setup" not in info:  # the sandbox failed before the program ran
        files["stderr"].seek(0)
        stderr = files["stderr"].read()[-2000:].decode(errors="replace")
        raise SandboxError(f"the sandbox could not start the program: {stderr}")
    if program.get("error") == "MemoryError":
        return result(CaseStatus.MEMORY, f"memory limit of {limits.memory_mb} MB")
    if exit_info["code"] in (-signal.SIGKILL, -signal.SIGXCPU):
        return result(CaseStatus.TIMEOUT, f"CPU time limit of {math.ceil(limits.timeout_s)} s")
    if program.get("error"):
        failed_assert = isinstance(test, AssertTest) and program["error"] == "AssertionError"
        status = CaseStatus.WRONG_ANSWER if failed_assert else CaseStatus.RUNTIME_ERROR
        return result(status, f"{program['error']}: {program.get('message', '')}")
    if exit_info["code"] != 0:
        files["stderr"].seek(0)
        tail = files["stderr"].read()[-300:].decode(errors="replace")
        return result(CaseStatus.RUNTIME_ERROR, f"exit status {exit_info['code']}: {tail}")
    if isinstance(test, StdioTest):
        files["stdout"].seek(0)
        got = files["stdout"].read(limits.max_output_bytes).decode(errors="replace")
        if _same_stdout(got, test.output):
            return result(CaseStatus.PASSED)
        return result(CaseStatus.WRONG_ANSWER, f"expected {test.output[:100]!r}, got {got[:100]!r}")
    if isinstance(test, CallTest):
        if "value" not in program:
            return result(CaseStatus.RUNTIME_ERROR, "the call returned no value (the program exited)")
        if _same_value(program["value"], test.expected):
            return result(CaseStatus.PASSED)
        return result(CaseStatus.WRONG_ANSWER,
                      f"expected {str(test.expected)[:100]}, got {str(program['value'])[:100]}")
    return result(CaseStatus.PASSED)


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


# ---------------------------------------------------------------------------------------------
# The sandboxed process (runs as `python -I -B code.py config.json`; standard library only)

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")

# LeetCode/HumanEval-style code uses these names (`List[int]`) without importing them.
_PRELUDE = "from typing import *\nimport collections, heapq, bisect, math, itertools, functools\n"

_REFUSED_EVENTS = {
    "socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
    "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
}
# audit event -> indices of the path arguments that must stay inside the working directory
_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (1,),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.mkfifo": (0,), "os.mknod": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _bootstrap(config_path: str) -> None:
    """Isolate, fork the program, enforce the wall clock, kill and reap what it left, report."""
    with open(config_path) as f:
        config = json.load(f)
    libc = ctypes.CDLL(None, use_errno=True)
    namespaces = _enter_namespaces(libc)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the program come back to us
    pid = os.fork()
    if pid == 0:
        try:
            _program_process(config, libc, namespaces)  # exits, unless its setup raises
        except BaseException:
            traceback.print_exc()
        os._exit(70)
    deadline = time.monotonic() + config["timeout_s"]
    timed_out = False
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    _kill_group(pid)  # still a zombie, so its process group id cannot have been reused
    _, status = os.waitpid(pid, 0)
    _reap_orphans()
    _report(config, {"exit": {"code": os.waitstatus_to_exitcode(status), "timed_out": timed_out}})


def _enter_namespaces(libc) -> bool:
    flags = _CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID
    if _unshare(libc, flags):
        return True
    uid, gid = os.getuid(), os.getgid()
    if not _unshare(libc, _CLONE_NEWUSER | flags):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _unshare(libc, flags: int) -> bool:
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(flags)
            return True
        except OSError:
            return False
    return libc.unshare(flags) == 0


def _program_process(config: dict, libc, namespaces: bool) -> None:
    os.setpgid(0, 0)
    drop_root = os.geteuid() == 0 and (namespaces or not _unreachable_dirs())
    if namespaces:
        _private_mounts(libc, cover_unreachable=drop_root)
        os.chdir("/tmp")
    workdir = os.getcwd()
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    if drop_root:
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    _set_limits(config)
    _report(config, {"setup": {"isolation": "namespaces" if namespaces else "guard"}})
    sys.addaudithook(_guard(workdir))
    _run_program(config)


def _interpreter_dirs() -> set[str]:
    return {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix)}


def _closed_ancestor(path: str) -> str | None:
    """The first directory on the way to `path` that others may not enter, if any."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        ancestor = os.sep.join(parts[:i])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _unreachable_dirs() -> list[str]:
    return [a for a in map(_closed_ancestor, _interpreter_dirs()) if a]


def _private_mounts(libc, cover_unreachable: bool) -> None:
    """Private tmpfs on the temporary directories (and on closed ancestors of the interpreter,
    which is then bind-mounted back in place through descriptors opened beforehand)."""
    _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE)
    covered = {d: "size=64m,mode=1777" for d in _PRIVATE_TMP if os.path.isdir(d)}
    if cover_unreachable:
        covered.update({d: "size=1m,mode=755" for d in _unreachable_dirs()})
    keep = {d: os.open(d, os.O_PATH | os.O_DIRECTORY) for d in _interpreter_dirs()
            if any(d == c or d.startswith(c + os.sep) for c in covered)}
    for directory in sorted(covered, key=len):
        _mount(libc, "tmpfs", directory, "tmpfs", 0, covered[directory])
    for directory, fd in keep.items():
        os.makedirs(directory, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", directory, None, _MS_BIND | _MS_REC)
        os.close(fd)


def _mount(libc, source: str, target: str, fstype: str | None, flags: int,
           options: str | None = None) -> None:
    src, dst, kind, opts = (None if s is None else s.encode() for s in (source, target, fstype, options))
    if libc.mount(src, dst, kind, flags, opts) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _set_limits(config: dict) -> None:
    cpu = max(1, math.ceil(config["timeout_s"]))  # soft = hard: SIGKILL, which even a PID 1 obeys
    for limit, value in ((resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_AS, config["memory_mb"] << 20),
                         (resource.RLIMIT_NPROC, config["max_processes"]),
                         (resource.RLIMIT_FSIZE, config["max_output_bytes"] + 1),
                         (resource.RLIMIT_NOFILE, config["max_open_files"]),
                         (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def _guard(workdir: str):
    root = os.path.realpath(workdir)

    def inside(path) -> bool:
        if isinstance(path, int):  # an open descriptor
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event in _REFUSED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = flags & _WRITE_FLAGS or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in _PATH_EVENTS and not all(inside(args[i]) for i in _PATH_EVENTS[event]):
            raise PermissionError(f"sandbox: {event} outside the working directory")

    return hook


def _run_program(config: dict) -> None:
    kind = config["kind"]
    namespace = {"__name__": "__main__" if kind == "stdio" else "solution", "__builtins__": __builtins__}
    sys.argv = ["solution.py"]
    outcome: dict = {}
    try:
        if kind != "stdio":
            exec(_PRELUDE, namespace)
        exec(compile(config["source"], "solution.py", "exec"), namespace)
        if kind == "call":
            outcome["value"] = _function(namespace, config["fn_name"])(*config["args"])
        elif kind == "assert":
            exec(compile(config["test_code"], "test.py", "exec"), namespace)
    except SystemExit as e:
        if e.code not in (None, 0):
            outcome = {"error": "SystemExit", "message": f"exit status {e.code}"}
    except BaseException as e:  # the program's failure is the result, whatever it is
        outcome = {"error": type(e).__name__, "message": str(e)[:300]}
    try:
        sys.stdout.flush()
    except OSError:
        pass  # past the output limit; the caller sees the size
    _report(config, {"program": outcome})
    os._exit(1 if "error" in outcome else 0)


def _function(namespace: dict, name: str):
    if name in namespace:
        return namespace[name]
    if "Solution" in namespace and hasattr(namespace["Solution"], name):
        return getattr(namespace["Solution"](), name)
    raise NameError(f"the program defines no function {name!r} (nor Solution.{name})")


def _report(config: dict, record: dict) -> None:
    os.write(config["result_fd"], (json.dumps(record, default=repr) + "\n").encode())


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap_orphans(wait_s: float = 1.0) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:
            return


if __name__ == "__main__":
    _bootstrap(sys.argv[1])
