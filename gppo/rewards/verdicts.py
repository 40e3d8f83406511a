"""What a test case is, the limits it runs under, and the verdict on its run.

The test cases (`StdioTest`, `CallTest`, `AssertTest`), `Limits`, and the outcome of a case
(`CaseStatus`, `CaseResult`); `gppo.rewards.code`, which runs programs against them, imports them
for its callers. `judge` decides the outcome from what only the sandbox's bootstrap writes (the
status file) and the program's output, in the caller's process: the expected outputs never reach
the sandbox (docs/sandbox.md).

Outputs of stdin/stdout tests are compared token by token (any run of whitespace separates
tokens, so trailing spaces and newlines do not matter); two numeric tokens also match when they
are equal as decimals or, if the expected token is a float (has a fraction or exponent), within
1e-6 (absolute or relative): see `same_number`. Call results: see `same_value`. Problems
needing a special checker (several valid answers) are not supported.
"""

from __future__ import annotations

import json
import math
import os
import signal
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


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program under test)."""


def judge(test: CodeTest, files: dict, limits: Limits, killed: bool, elapsed: float) -> CaseResult:
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
        if same_stdout(got, test.output):
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
    if same_value(value, test.expected):
        return result(CaseStatus.PASSED)
    return result(CaseStatus.WRONG_ANSWER, f"expected {str(test.expected)[:100]}, got {str(value)[:100]}")


def _failure(result, message: str, stderr: str, exit_code: int, limits: Limits) -> CaseResult:
    """A program that failed: out of memory, out of CPU time, or any other error."""
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    if message.startswith("MemoryError") or last_line.startswith("MemoryError"):
        return result(CaseStatus.MEMORY, f"memory limit of {limits.memory_mb} MB")
    if exit_code in (-signal.SIGKILL, -signal.SIGXCPU):
        return result(CaseStatus.TIMEOUT, f"CPU time limit of {_wire.cpu_seconds(limits.timeout_s)} s")
    return result(CaseStatus.RUNTIME_ERROR, message or f"exit status {exit_code}: {stderr[-300:]}")


def same_stdout(got: str, expected: str) -> bool:
    """A program's stdout against the expected output, token by token (numbers: `same_number`)."""
    a, b = got.split(), expected.split()
    return len(a) == len(b) and all(x == y or same_number(x, y) for x, y in zip(a, b))


_UNTRAPPED = Context(traps=[])


def same_number(got: str, expected: str) -> bool:
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


def same_value(got: Any, expected: Any) -> bool:
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
        return type(got) in (list, tuple) and len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return False
        got_keys = {_json_key(k): k for k in got}
        expected_keys = {_json_key(k): k for k in expected}
        return (
            len(got_keys) == len(got)
            and got_keys.keys() == expected_keys.keys()
            and all(same_value(got[got_keys[k]], expected[expected_keys[k]]) for k in got_keys)
        )
    return type(got) is type(expected) and got == expected


def _json_key(key: Any) -> Any:
    return key if type(key) is str else json.dumps(key) if type(key) in (bool, int, float, type(None)) else key
