"""The code sandbox: limits, isolation, judging, the parallel pool, code extraction."""

import collections
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gppo.rewards import code as sandbox
from gppo.rewards import verdicts
from gppo.rewards.code import (
    AssertTest,
    CallTest,
    CaseStatus,
    Limits,
    StdioTest,
    extract_code,
    io_tests,
    run_many,
    run_test,
    score_code,
)
from gppo.rewards.pool import ProgramPool, _Server

FAST = Limits(timeout_s=2)
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def runtime_in_tmp() -> list[str]:
    """What a private root's /tmp holds before any program writes there: the names of this
    interpreter's directories that lie under /tmp (a venv in a clone under /tmp), bound read-only."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = {q for p in prefixes for q in (os.path.abspath(p), os.path.realpath(p))}
    return sorted({p.split("/")[2] for p in paths | {os.path.realpath(sys.executable)} if p.startswith("/tmp/")})


def sandbox_processes() -> set[int]:
    """Live processes running the sandbox (bootstraps, bwrap, pools' servers and the programs' processes)."""
    markers = (str(Path(sandbox._RUNNER).resolve()).encode(), b"_code_child.py", b"_code_server.py")
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and any(m in Path(f"/proc/{entry}/cmdline").read_bytes() for m in markers):
                pids.add(int(entry))
        except OSError:
            pass  # exited meanwhile
    return pids


def zombie_children() -> list[int]:
    zombies = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(entry))
    return zombies


@pytest.fixture(scope="module")
def root_without_namespaces():
    """Whether programs run as root with only the Python guard (no fork-bomb protection then)."""
    probe = run_test("import os\nprint(os.getuid())", StdioTest("", "0"), FAST)
    return probe.isolation == "guard" and probe.status is CaseStatus.PASSED


def test_correct_and_wrong_stdin_programs():
    assert run_test(SUM, StdioTest("2 3\n", "5\n"), FAST).status is CaseStatus.PASSED
    wrong = run_test(SUM.replace("a + b", "a - b"), StdioTest("2 3\n", "5\n"), FAST)
    assert wrong.status is CaseStatus.WRONG_ANSWER and "expected" in wrong.detail


def test_reads_all_of_stdin_and_compares_tokens():
    program = "import sys\nnums = sorted(int(x) for x in sys.stdin.read().split())\nprint(*nums, sep='\\n')\n"
    result = run_test(program, StdioTest("3\n1\n  2\n", "1 2   3"), FAST)
    assert result.status is CaseStatus.PASSED


def test_numeric_tokens_match_within_tolerance():
    assert run_test("print(1/3)", StdioTest("", "0.333333333"), FAST).status is CaseStatus.PASSED
    assert run_test("print(0.3)", StdioTest("", "0.31"), FAST).status is CaseStatus.WRONG_ANSWER
    assert run_test("print(10**18 + 1)", StdioTest("", str(10**18)), FAST).status is CaseStatus.WRONG_ANSWER


def test_runtime_error_names_the_exception():
    result = run_test("print(1 // 0)", StdioTest("", "1"), FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "ZeroDivisionError" in result.detail


def test_call_tests_on_functions_and_solution_methods():
    function = "def add(a, b):\n    return a + b\n"
    assert run_test(function, CallTest("add", [2, 3], 5), FAST).status is CaseStatus.PASSED
    assert run_test(function, CallTest("add", [2, 3], 6), FAST).status is CaseStatus.WRONG_ANSWER
    method = "class Solution:\n    def pair(self, xs: List[int]) -> Tuple[int, int]:\n        return min(xs), max(xs)\n"
    assert run_test(method, CallTest("pair", [[3, 1, 2]], [1, 3]), FAST).status is CaseStatus.PASSED
    missing = run_test(function, CallTest("sub", [1, 1], 0), FAST)
    assert missing.status is CaseStatus.RUNTIME_ERROR and "sub" in missing.detail


def test_assert_tests():
    function = "def double(x):\n    return 2 * x\n"
    assert run_test(function, AssertTest("assert double(4) == 8"), FAST).status is CaseStatus.PASSED
    assert run_test(function, AssertTest("assert double(4) == 9"), FAST).status is CaseStatus.WRONG_ANSWER


def test_infinite_loop_times_out_within_the_limit():
    start = time.monotonic()
    result = run_test("while True:\n    pass\n", StdioTest("", ""), Limits(timeout_s=1))
    assert result.status is CaseStatus.TIMEOUT
    assert time.monotonic() - start < 1 + 2.0


def test_ten_gigabyte_allocation_is_a_memory_error():
    start = time.monotonic()
    program = "x = bytearray(10 * 1024 ** 3)\nprint(len(x))"
    result = run_test(program, StdioTest("", ""), Limits(timeout_s=5, memory_mb=512))
    assert result.status is CaseStatus.MEMORY
    assert time.monotonic() - start < 5  # refused at once, nothing was paged in
    assert run_test(SUM, StdioTest("1 1", "2"), FAST).status is CaseStatus.PASSED  # the host still works


def test_fork_bomb_is_contained(root_without_namespaces):
    if root_without_namespaces:
        pytest.skip("RLIMIT_NPROC cannot bind root, and without namespaces the sandbox stays root here")
    before = sandbox_processes()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_test(bomb, StdioTest("", ""), Limits(timeout_s=1, max_processes=32))
    assert result.status is CaseStatus.TIMEOUT
    assert sandbox_processes() - before == set()
    assert zombie_children() == []


def test_writes_outside_the_working_directory_do_not_reach_the_host():
    name = f"gppo-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", os.path.join(os.path.expanduser("~"), name), str(Path(__file__).parent / name)]
    program = (
        "import os\n"
        f"for path in {targets!r} + [os.path.expanduser('~/{name}')]:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "    except OSError:\n"
        "        pass\n"
        "print('done')\n"
    )
    try:
        assert run_test(program, StdioTest("", "done"), FAST).status is CaseStatus.PASSED
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)


def test_sockets_are_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n"
            "    print('connected')\n"
            "except OSError:\n"
            "    print('refused')\n"
        )
        assert run_test(program, StdioTest("", "refused"), FAST).status is CaseStatus.PASSED
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_huge_output_is_cut_at_the_byte_cap():
    start = time.monotonic()
    result = run_test(
        "while True:\n    print('x' * 1000)\n", StdioTest("", ""), Limits(timeout_s=5, max_output_bytes=64 * 1024)
    )
    assert result.status is CaseStatus.OUTPUT_LIMIT and "65536" in result.detail
    assert time.monotonic() - start < 5


def test_pool_of_32_programs_finishes_and_leaves_no_processes():
    before = sandbox_processes()
    leaves_a_child = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n" + SUM
    programs = [SUM, SUM.replace("a + b", "a * b"), leaves_a_child, "raise SystemExit(3)"] * 8
    start = time.monotonic()
    results = run_many([(p, [StdioTest("2 3\n", "5\n")]) for p in programs], FAST, max_workers=4)
    assert time.monotonic() - start < 30
    statuses = [r[0].status for r in results]
    expected = [CaseStatus.PASSED, CaseStatus.WRONG_ANSWER, CaseStatus.PASSED, CaseStatus.RUNTIME_ERROR]
    assert statuses == expected * 8
    assert sandbox_processes() - before == set()
    assert zombie_children() == []
    assert not list(Path(tempfile.gettempdir()).glob("gppo-sandbox-*"))  # private directories are deleted


def test_score_code_rewards_and_failures():
    tests = io_tests(["1 2\n", "2 2\n", "5 5\n"], ["3\n", "4\n", "10\n"])
    times = "```python\n" + SUM.replace("a + b", "a * b") + "```"  # right only on "2 2"
    good = f"Here it is:\n```python\n{SUM}```\n"
    fraction = score_code([good, times], [tests, tests], FAST, all_or_nothing=False)
    assert [r.reward for r in fraction] == [1.0, pytest.approx(1 / 3)]
    assert fraction[0].passed and not fraction[1].passed
    strict = score_code([times], [tests], FAST)
    assert strict[0].reward == 0.0 and len(strict[0].cases) == 1  # stops at the first failure
    nothing, broken = score_code(["no code here, sorry.", "```python\ndef f(:\n```"], [tests, tests], FAST)
    assert nothing.reward == 0.0 and "no Python code" in nothing.error
    assert broken.reward == 0.0 and "does not parse" in broken.error and broken.cases == []


def test_io_tests_from_livecodebench_and_taco_layouts():
    assert io_tests(["[1, 2]\n3"], ["[1, 2, 3]"], "append") == [CallTest("append", [[1, 2], 3], [1, 2, 3])]
    assert io_tests([[1, 2]], [3], "add") == [CallTest("add", [1, 2], 3)]
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        io_tests(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="test 0: stdin tests need string"):
        io_tests([[1]], ["1"])
    with pytest.raises(ValueError, match="must be JSON"):
        io_tests(["not json"], ["1"], "f")


def test_limits_name_the_bad_field():
    with pytest.raises(ValueError, match="Limits.timeout_s must be positive"):
        Limits(timeout_s=0)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n"),
        ("```py\nx = 1\n```\n```text\nnot code\n```", "x = 1\n"),
        ("```\nprint(3)\n```", "print(3)\n"),
        ("<think>```python\nprint(0)\n```</think>final:\n```python\nprint(4)\n```", "print(4)\n"),
        ("Answer:\n```python\nprint(5)\nfor i in range(", "print(5)\nfor i in range("),
        ("print(6)\n", "print(6)\n"),
        ("I think the answer is to loop over it.", None),
        ("", None),
    ],
)
def test_extract_code(completion, expected):
    assert extract_code(completion) == expected


# ---------------------------------------------------------------------------------------------
# Reward hacking: a program must not score without passing its test

WRONG = "def f(x):\n    return x\n"  # f(1) should be 2
ASSERTS = AssertTest("assert f(1) == 2\nassert f(5) == 6\n")
HUMANEVAL = AssertTest(
    "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 6\n\ncheck(f)\n"
)
CALL = CallTest("f", [1], 2)
STDIO = StdioTest("1\n", "2\n")


def assert_scores_zero(program: str, test) -> None:
    scored = score_code([f"```python\n{program}```"], [[test]], FAST)[0]
    assert scored.reward == 0.0 and scored.cases[0].status is not CaseStatus.PASSED, scored


@pytest.mark.parametrize("test", [ASSERTS, HUMANEVAL, CALL], ids=["assert", "check", "call"])
@pytest.mark.parametrize(
    "exit_call",
    [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "raise SystemExit\n",
        "exit()\n",
        "import _thread\n_thread.exit()\n",
    ],
    ids=["sys.exit", "os._exit", "SystemExit", "exit", "thread.exit"],
)
def test_exiting_before_the_tests_scores_zero(exit_call, test):
    assert_scores_zero(exit_call + WRONG, test)


@pytest.mark.parametrize("test", [ASSERTS, HUMANEVAL, CALL], ids=["assert", "check", "call"])
@pytest.mark.parametrize(
    "exit_call", ["import sys\n    sys.exit(0)", "import os\n    os._exit(0)"], ids=["sys.exit", "os._exit"]
)
def test_exiting_inside_the_tested_function_scores_zero(exit_call, test):
    assert_scores_zero(f"def f(x):\n    {exit_call}\n", test)


@pytest.mark.parametrize(
    "program, test",
    [
        ("raise SystemExit('2')\n", STDIO),  # the expected output, but as the exit message (stderr)
        ("print(2)\nraise SystemExit(2)\n", STDIO),
        ("print(2)\nraise SystemExit\n" + WRONG, ASSERTS),
        ("raise SystemExit(2)\n", CALL),
    ],
    ids=["stdio-message", "stdio-status", "assert", "call"],
)
def test_system_exit_with_the_expected_output_scores_zero(program, test):
    assert_scores_zero(program, test)


@pytest.mark.parametrize(
    "crash",
    [
        "1 / 0",
        "import os\nos._exit(1)",
        "import os\nos.abort()",
        "import functools\nsys.setrecursionlimit(1 << 30)\ng = functools.lru_cache(None)(lambda n: g(n + 1))\ng(0)",
    ],
    ids=["exception", "os._exit(1)", "abort", "stack-overflow"],
)
def test_printing_the_expected_output_then_crashing_scores_zero(crash):
    assert_scores_zero(f"import sys\nprint(2)\nsys.stdout.flush()\n{crash}\n", STDIO)


@pytest.mark.parametrize(
    "kill",
    [
        "os.kill(os.getppid(), signal.SIGKILL)",
        "os.killpg(os.getpgid(0), signal.SIGKILL)",
        "signal.pthread_kill(threading.main_thread().ident, signal.SIGKILL)",
    ],
    ids=["parent", "group", "main-thread"],
)
@pytest.mark.parametrize("test", [ASSERTS, CALL, STDIO], ids=["assert", "call", "stdio"])
def test_killing_the_parent_or_the_harness_scores_zero(kill, test):
    program = f"import os, signal, threading\n{kill}\nprint(2)\n" + WRONG
    assert_scores_zero(program, test)
    assert run_test(SUM, StdioTest("1 1", "2"), FAST).status is CaseStatus.PASSED  # the caller lives on


@pytest.mark.parametrize(
    "test",
    [ASSERTS, HUMANEVAL, AssertTest("if f(1) != 2:\n    raise AssertionError('f(1)')\n")],
    ids=["assert", "check", "raise"],
)
def test_redefining_assertion_error_or_check_scores_zero(test):
    program = (
        "import builtins\nclass AssertionError(Exception):\n    pass\nbuiltins.AssertionError = AssertionError\n"
        "def check(candidate):\n    pass\n" + WRONG
    )
    assert_scores_zero(program, test)


@pytest.mark.parametrize(
    "patch, test_code",
    [
        ("import builtins\nbuiltins.abs = lambda v: 0", "assert abs(f(1) - 2) < 1e-9"),
        ("abs = lambda v: 0", "assert abs(f(1) - 2) < 1e-9"),
        ("import builtins\nbuiltins.all = lambda v: True", "assert all([f(1) == 2])"),
        (
            "import builtins, types\nreal = builtins.__import__\nfake = types.SimpleNamespace(isclose=lambda *a, **k: True)\n"
            "builtins.__import__ = lambda name, *a, **k: fake if name == 'math' else real(name, *a, **k)",
            "import math\nassert math.isclose(f(1), 2)",
        ),
        (
            "import builtins\nbuiltins.print = lambda *a, **k: None\nbuiltins.exec = lambda *a, **k: None",
            "assert f(1) == 2",
        ),
    ],
    ids=["builtins.abs", "global-abs", "builtins.all", "__import__", "print-exec"],
)
def test_patched_builtins_do_not_reach_the_tests(patch, test_code):
    assert_scores_zero(patch + "\n" + WRONG, AssertTest(test_code))
    # the same test still passes a right answer
    assert run_test("def f(x):\n    return x + 1\n", AssertTest(test_code), FAST).status is CaseStatus.PASSED


@pytest.mark.parametrize(
    "program, test_code",
    [
        (
            "class X:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return X()\n",
            "assert f(1) == 2",
        ),
        (
            "class X(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return X(0)\n",
            "assert f(1) == 2",
        ),
        (
            "class X:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return [X()]\n",
            "assert f(1) == [2]",
        ),
        (
            "class X:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return {1: X()}\n",
            "assert f(1) == {1: 2}",
        ),
        (
            "class X:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return (X() for _ in range(2))\n",
            "assert list(f(1)) == [2, 2]",
        ),
        (
            "class X:\n    def __sub__(self, other):\n        return 0\n    __rsub__ = __sub__\ndef f(x):\n    return X()\n",
            "assert abs(f(1) - 2) < 1e-9",
        ),
        ("class X:\n    def __bool__(self):\n        return True\ndef f(x):\n    return X()\n", "assert f(1)"),
        (
            "import collections\nclass X:\n    def __eq__(self, other):\n        return True\n"
            "def f(x):\n    return collections.UserList([X()])\n",
            "assert f(1) == [2]",
        ),
        (
            "class X:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    xs = [X()]\n    xs.append(xs)\n"
            "    return xs\n",
            "assert f(1)[0] == 2",
        ),
        (
            "def f(x):\n    collections.Counter.__eq__ = lambda self, other: True\n    return collections.Counter()\n",
            "assert f(1) == {1: 2}",
        ),
        (
            "def f(x):\n    collections.ChainMap.__eq__ = lambda self, other: True\n    return collections.ChainMap()\n",
            "assert f(1) == {1: 2}",
        ),
    ],
    ids=[
        "eq",
        "int-subclass",
        "in-list",
        "in-dict",
        "generator",
        "sub",
        "bool",
        "in-attribute",
        "cycle",
        "patched-class",
        "class-attribute-added",
    ],
)
def test_objects_that_answer_comparisons_themselves_score_zero(program, test_code):
    assert_scores_zero(program, AssertTest(test_code))


@pytest.mark.parametrize(
    "program",
    [
        "import math\nmath.isclose = lambda *a, **k: True\n" + WRONG,
        "import math\ndef f(x):\n    math.isclose = lambda *a, **k: True\n    return x\n",
        "import sys, types\nsys.modules['math'] = types.SimpleNamespace(isclose=lambda *a, **k: True)\n" + WRONG,
        "import math\ndel math.isclose\nmath.isclose = lambda *a, **k: True\n" + WRONG,
    ],
    ids=["module-attribute", "during-the-test", "sys.modules", "deleted"],
)
def test_patching_the_standard_library_scores_zero(program):
    assert_scores_zero(program, AssertTest("import math\nassert math.isclose(f(1), 2)\nassert math.isclose(f(2), 3)"))


@pytest.mark.parametrize(
    "program, test_code",
    [
        ("def f(s):\n    return Counter(s)\n", "assert f('aab') == {'a': 2, 'b': 1}"),
        ("def f(n):\n    return (i * i for i in range(n))\n", "assert list(f(3)) == [0, 1, 4]"),
        ("def f(n):\n    return collections.deque(range(n))\n", "assert list(f(2)) == [0, 1]"),
        (
            "@functools.lru_cache(None)\ndef f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)\n",
            "assert f(30) == 832040",
        ),
        (
            "import random, re, warnings\ndef f(s):\n    with warnings.catch_warnings():\n        warnings.simplefilter('ignore')\n"
            "    random.seed(0)\n    return re.sub('a', 'b', s)\n",
            "assert f('aa') == 'bb'",
        ),
        (
            "class Solution:\n    def f(self, xs: List[int]) -> int:\n        return sum(xs)\n",
            "assert Solution().f([1, 2]) == 3",
        ),
        ("import copy\ndef f(s):\n    return copy.deepcopy(Counter(s))\n", "assert f('a') == {'a': 1}"),
        (
            "def f(x):\n    return (x, [x], {x: x}, {x}, None, 1.5, 'a', b'b', True)\n",
            "assert f(1) == (1, [1], {1: 1}, {1}, None, 1.5, 'a', b'b', True)",
        ),
    ],
    ids=["Counter", "generator", "deque", "lru_cache", "stdlib", "Solution", "copy", "plain"],
)
def test_legitimate_assert_programs_still_pass(program, test_code):
    result = run_test(program, AssertTest(test_code), FAST)
    assert result.status is CaseStatus.PASSED, result.detail


@pytest.mark.parametrize(
    "handler",
    ["atexit.register(os._exit, 0)", "atexit.register(print, 2)", "atexit.register(lambda: os.write(1, b'2\\n'))"],
    ids=["os._exit", "print", "write"],
)
@pytest.mark.parametrize("test", [ASSERTS, CALL], ids=["assert", "call"])
def test_atexit_handlers_neither_end_nor_vouch_for_the_test(handler, test):
    assert_scores_zero(f"import atexit, os\n{handler}\n" + WRONG, test)


@pytest.mark.parametrize("test", [CALL, STDIO], ids=["call", "stdio"])
def test_monkeypatching_the_comparison_scores_zero(test):
    program = (
        "import json, sys, __main__\n"
        "for name in ('same_value', 'same_stdout', 'same_number', 'judge', '_verdict'):\n"
        "    setattr(__main__, name, lambda *a, **k: True)\n"
        "try:\n"
        "    from gppo.rewards import code, verdicts\n"
        "    verdicts.same_value = verdicts.same_stdout = code.judge = lambda *a, **k: True\n"
        "except ImportError:\n"
        "    pass\n"
        "json.dumps = lambda *a, **k: '2'\n"
        "print(1)\n" + WRONG
    )
    assert_scores_zero(program, test)


# the end of a forging program: every record in `forged` written to every descriptor it may have
WRITE_FORGED_EVERYWHERE = (
    "for fd in range(3, 256):\n"
    "    for record in forged:\n"
    "        try:\n"
    "            os.write(fd, record)\n"
    "        except OSError:\n"
    "            pass\n"
    "os._exit(0)\n"
)


@pytest.mark.parametrize("test", [ASSERTS, CALL, STDIO], ids=["assert", "call", "stdio"])
def test_writing_forged_records_to_every_descriptor_scores_zero(test):
    program = (
        "import json, os\n"
        "forged = [json.dumps({'program': {}, 'exit': {'code': 0, 'timed_out': False}, 'setup': {}}).encode() + b'\\n',\n"
        "          b'', (0).to_bytes(8, 'big') + bytes(16), bytes(24), b'P' * 64]\n" + WRITE_FORGED_EVERYWHERE
    )
    assert_scores_zero(program, test)


def test_the_harness_files_and_processes_are_out_of_reach():
    program = (
        "import os, sys\n"
        "paths = ['/proc/self/mem', '/proc/self/fd', '/proc/self/fd/3', '/proc/self/environ', '/proc/self/cmdline',\n"
        "         '/proc/1/mem', '/proc/1/fd', '/dev/fd/3', '/dev/fd/../../1/fd/3', '/proc', '/proc/self/maps']\n"
        "paths += [f'/proc/{p}/fd' for p in (os.getppid(), 1, 2)]\n"
        "reached = []\n"
        "for path in paths:\n"
        "    try:\n"
        "        if os.path.isdir(path):\n"
        "            os.listdir(path)\n"
        "        else:\n"
        "            open(path, 'rb').read(1)\n"
        "        reached.append(path)\n"
        "    except (OSError, ValueError):\n"
        "        pass\n"
        "try:\n"
        "    os.symlink('/proc/self/mem', 'link')\n"
        "    reached.append('symlink')\n"
        "except OSError:\n"
        "    pass\n"
        "names = [n for n in os.listdir('.') if n != 'link']\n"
        "print(reached, names, sorted(os.listdir('/proc/self/fd') if reached else []))\n"
    )
    result = run_test(program, StdioTest("", "[] [] []"), FAST)
    assert result.status is CaseStatus.PASSED, result.detail


@pytest.mark.parametrize(
    "attempt",
    [
        "sys._getframe(1).f_locals",
        "sys._getframe().f_back",
        "inspect.currentframe()",
        "gc.get_objects()",
        "gc.get_referrers(sys.modules)",
        "sys._current_frames()",
        "sys.settrace(lambda *a: None)",
        "sys.setprofile(lambda *a: None)",
        "(lambda: (yield))().gi_frame",
        "exec('try:\\n    1 / 0\\nexcept Exception as e:\\n    e.__traceback__.tb_frame')",
        "import __main__\n__main__._describe.__code__ = (lambda error: b'').__code__",
        "import ctypes",
        "import _posixsubprocess\n_posixsubprocess.fork_exec(*[None] * 21)",
        "import importlib.machinery, _imp\nspec = importlib.machinery.PathFinder.find_spec('_ctypes')\n"
        "spec.name = 'package._ctypes'\n_imp.create_dynamic(spec)",
        "import importlib.machinery, _imp, shutil\nspec = importlib.machinery.PathFinder.find_spec('_json')\n"
        "shutil.copy(spec.origin, 'own.so')\nspec.origin = 'own.so'\n_imp.create_dynamic(spec)",
    ],
    ids=lambda a: a.split("(")[0].replace("\n", " ")[:40],
)
def test_frames_objects_and_native_code_are_refused(attempt):
    program = f"import gc, inspect, sys, threading\n{WRONG}{attempt}\nprint('reached')\n"
    result = run_test(program, StdioTest("", ""), FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "reached" not in result.detail, result


def test_hooks_a_program_installs_never_run():
    program = (
        "import sys, threading\n"
        "calls = []\n"
        "sys.addaudithook(lambda *a: calls.append('audit'))\n"  # refused silently, as Python does
        "threading.settrace(lambda *a: calls.append('trace'))\n"  # refused in the new thread
        "thread = threading.Thread(target=len, args=([],))\n"
        "thread.start()\n"
        "thread.join()\n"
        "open('file', 'w').close()\n"
        "print(calls)\n"
    )
    result = run_test(program, StdioTest("", "[]"), FAST)
    assert result.status is CaseStatus.PASSED, result.detail


@pytest.mark.parametrize(
    "program",
    [
        SUM + "exit()\nprint('not reached')\n",
        "import sys\n" + SUM + "sys.exit(0)\n",
        "import sys, threading\nthreading.stack_size(1 << 26)\n"
        "def main():\n    a, b = map(int, input().split())\n    print(a + b)\nthreading.Thread(target=main).start()\n",
        "from collections import namedtuple\nfrom dataclasses import dataclass\nfrom enum import Enum\n"
        "import asyncio, logging, subprocess, typing\n"
        "P = namedtuple('P', 'x')\nE = Enum('E', 'a b')\nT = typing.TypeVar('T')\n@dataclass\nclass D:\n    x: int\n"
        "logging.getLogger('x').debug('hidden')\n" + SUM,
        "data = open('/dev/stdin').read().split()\nprint(int(data[0]) + int(data[1]))\n",
        "import sys\nsys.setrecursionlimit(100000)\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "assert depth(20000) == 20000\n" + SUM,
        "import functools, sys\nsys.setrecursionlimit(100000)\n@functools.lru_cache(None)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\nassert depth(3000) == 3000\n" + SUM,
    ],
    ids=["exit", "sys.exit", "thread", "stdlib-frames", "dev-stdin", "recursion", "c-recursion"],
)
def test_legitimate_programs_still_pass(program):
    result = run_test(program, StdioTest("2 3\n", "5\n"), FAST)
    assert result.status is CaseStatus.PASSED, result.detail


def test_numpy_still_imports():
    pytest.importorskip("numpy")
    program = "import numpy as np\nprint(int(np.array(input().split(), dtype=int).sum()))\n"
    result = run_test(program, StdioTest("2 3\n", "5\n"), Limits(timeout_s=10))
    assert result.status is CaseStatus.PASSED, result.detail


# ---------------------------------------------------------------------------------------------
# The verdict is decided outside the program's process, from outputs that cross by value

SECRET = "gppo-secret-" + uuid.uuid4().hex  # an expected output no program could compute


_ISOLATION_WORKS: dict = {}


@pytest.fixture(params=["bwrap", "namespaces"])
def isolation(request, monkeypatch):
    """Run the test under bubblewrap (where it works here) and under the bootstrap's own
    namespaces (the fallback, what a fresh machine without bwrap gets)."""
    if request.param == "bwrap" and sandbox._isolation()[0] != "bwrap":
        pytest.skip("bubblewrap is not installed or cannot make namespaces here")
    if request.param == "namespaces":
        monkeypatch.setattr(sandbox, "_isolation", lambda: ("namespaces", None))
    if request.param not in _ISOLATION_WORKS:
        probe = run_test("print(1)", StdioTest("", "1"), Limits(timeout_s=10))
        assert probe.status is CaseStatus.PASSED, probe
        _ISOLATION_WORKS[request.param] = probe.isolation == request.param
    if not _ISOLATION_WORKS[request.param]:
        pytest.skip(f"no {request.param} isolation on this machine (docs/sandbox.md: what is visible then)")
    return request.param


def hunter(data_file: str) -> str:
    """A program that looks for an expected output everywhere it can: the harness's frames and
    globals (after trying to switch off the audit hook through them), every descriptor, the
    environment, and the files of the data set and of the usual directories."""
    return f"""
import gc, inspect, os, sys
found = []
def look(text):
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    if isinstance(text, str) and "gppo-secret-" in text:
        start = text.index("gppo-secret-")
        found.append(text[start:start + 44])
def search(obj, depth=0, seen=set()):
    if id(obj) in seen or depth > 5:
        return
    seen.add(id(obj))
    if isinstance(obj, (str, bytes)):
        return look(obj)
    children = []
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "f_locals"):
        children = [obj.f_locals, obj.f_globals, obj.f_back]
    elif isinstance(obj, type(sys)):
        children = [vars(obj)]
    for child in children:
        search(child, depth + 1)
for module in list(sys.modules.values()):  # switch the audit hook off through its globals
    for name in ("_REFUSED_EVENTS", "_FRAME_ATTRIBUTES", "_REFUSED_MODULES", "_PATH_EVENTS"):
        if isinstance(getattr(module, name, None), (set, frozenset, dict)):
            setattr(module, name, type(getattr(module, name))())
routes = [lambda: sys._getframe(0), lambda: inspect.currentframe(), lambda: inspect.stack(),
          lambda: gc.get_objects(), lambda: list(sys.modules.values()), lambda: dict(os.environ), lambda: sys.argv]
for route in routes:
    try:
        search(route())
    except Exception:
        pass
try:
    1 / 0
except ZeroDivisionError as error:
    try:
        search(error.__traceback__.tb_frame)
    except Exception:
        pass
for fd in range(256):
    try:
        look(os.pread(fd, 1 << 20, 0))
    except OSError:
        pass
paths = [{data_file!r}]
for directory in ({os.path.dirname(data_file)!r}, "/tmp", "/work", os.path.expanduser("~"), "/", "."):
    try:
        paths += [os.path.join(directory, name) for name in os.listdir(directory)]
    except OSError:
        pass
for path in paths:
    try:
        with open(path, "rb") as file:
            look(file.read(1 << 20))
    except Exception:
        pass
ANSWER = found[0] if found else "nothing found"
def f(x):
    return ANSWER
if __name__ == "__main__":
    print(ANSWER)
"""


SECRET_TESTS = {
    "stdio": StdioTest("", SECRET),
    "call": CallTest("f", [1], SECRET),
    "assert": AssertTest(f"assert f(1) == {SECRET!r}"),
    "check": AssertTest(f"def check(candidate):\n    assert candidate(1) == {SECRET!r}\n\ncheck(f)\n"),
}


@pytest.fixture
def data_set():
    """A data set file that holds the expected output, readable by every user, beside the tests
    (where a clone keeps its data; pytest's tmp_path under /tmp was hidden even before)."""
    directory = tempfile.mkdtemp(prefix="data-", dir=Path(__file__).parent)
    os.chmod(directory, 0o755)
    path = Path(directory) / "expected_outputs.jsonl"
    path.write_text(json.dumps({"input": "", "output": SECRET}) + "\n")
    os.chmod(path, 0o644)
    yield str(path)
    shutil.rmtree(directory)


@pytest.mark.parametrize("kind", SECRET_TESTS)
def test_the_expected_output_is_nowhere_the_program_can_read(kind, isolation, data_set):
    result = run_test(hunter(data_set), SECRET_TESTS[kind], Limits(timeout_s=10))
    assert result.status is CaseStatus.WRONG_ANSWER, result


def test_the_hunter_finds_the_data_set_where_the_filesystem_is_visible(monkeypatch, data_set):
    """The control for the test above: without a private root ("guard", docs/sandbox.md), the
    same program reads the data set and prints the answer."""
    monkeypatch.setattr(sandbox, "_isolation", lambda: ("guard", None))
    result = run_test(hunter(data_set), SECRET_TESTS["stdio"], Limits(timeout_s=10))
    assert result.status is CaseStatus.PASSED and result.isolation == "guard", result


@pytest.mark.parametrize(
    "attempt",
    [
        "os.chdir(DATA)\nprint(open('expected_outputs.jsonl').read())",
        "os.chdir(os.path.dirname(DATA))\nos.chdir(os.path.basename(DATA))",
        "os.chdir('/proc/self')\nprint(open('environ').read())",
        "os.chdir('/proc')\nprint(os.listdir('.'))",
        "os.chdir('/')\nopen('escape', 'w').write(SECRET)\nprint(open('/escape').read())",
    ],
    ids=["data-set", "data-set-relative", "proc-self", "proc-listing", "root"],
)
def test_changing_directory_then_using_relative_paths_is_refused(attempt, isolation, data_set):
    data_dir = os.path.dirname(data_set)
    program = (
        f"import os\nDATA = {data_dir!r}\nSECRET = 'not the answer'\n"
        f"try:\n    " + attempt.replace("\n", "\n    ") + "\n    print('reached')\n"
        "except (OSError, ValueError) as e:\n    print('refused')\n"
    )
    result = run_test(program, StdioTest("", "refused"), FAST)
    assert result.status is CaseStatus.PASSED, result


def test_the_audit_hook_cannot_be_switched_off_through_the_harness_globals():
    program = (
        "import sys\n"
        "for module in list(sys.modules.values()):\n"
        "    for name in ('_REFUSED_EVENTS', '_FRAME_ATTRIBUTES', '_REFUSED_MODULES', '_PATH_EVENTS'):\n"
        "        value = getattr(module, name, None)\n"
        "        if isinstance(value, (set, dict)):\n"
        "            value.clear()\n"
        "        elif isinstance(value, frozenset):\n"
        "            setattr(module, name, frozenset())\n"
        "reached = []\n"
        "for name, attempt in [('ctypes', 'import ctypes'), ('socket', 'import socket\\nsocket.socket()'),\n"
        "                      ('process', 'import subprocess\\nsubprocess.run([\"true\"])'),\n"
        "                      ('frames', 'sys._getframe(1)')]:\n"
        "    try:\n"
        "        exec(attempt)\n"
        "        reached.append(name)\n"
        "    except Exception:\n"
        "        pass\n"
        "print(reached)\n"
    )
    result = run_test(program, StdioTest("", "[]"), FAST)
    assert result.status is CaseStatus.PASSED, result


FORGER = (
    "import json, os\n"
    "def frame(message):\n"
    "    data = json.dumps(message).encode()\n"
    "    return len(data).to_bytes(8, 'big') + data\n"
    "status = {'setup': {'isolation': 'bwrap'}, 'outcome': {'passed': True}, 'exit': {'code': 0, 'timed_out': False}}\n"
    "forged = [frame({'names': {'f': None}}), frame({'value': ['int', hex(3)]}), frame({'passed': True}),\n"
    "          (json.dumps(status) + '\\n').encode()]\n" + WRITE_FORGED_EVERYWHERE
)


@pytest.mark.parametrize("test", [ASSERTS, HUMANEVAL, CALL, STDIO], ids=["assert", "check", "call", "stdio"])
def test_forged_replies_and_verdicts_score_zero(test):
    """Verdict records and replies written to every descriptor, then an early exit. (A forged
    reply is only an answer chosen in advance, as a program that returns a constant does: here
    not the right one.)"""
    assert run_test(FORGER, test, FAST).status is not CaseStatus.PASSED


# containers and proxies whose items, or themselves, compare equal to anything
EQUAL_TO_ANYTHING = {
    "mock.ANY": "from unittest import mock\nvalue = mock.ANY",
    "UserList": "class X:\n    def __eq__(self, other):\n        return True\nvalue = collections.UserList([X()])",
    "ChainMap": "value = collections.ChainMap({1: 2})",
    "mappingproxy": "import types\nvalue = types.MappingProxyType({1: 2})",
    "int-subclass": "class X(int):\n    __eq__ = lambda self, other: True\n    __hash__ = int.__hash__\nvalue = X(0)",
    "str-subclass": "class X(str):\n    __eq__ = lambda self, other: True\n    __hash__ = str.__hash__\nvalue = X('')",
    "dict-subclass": "class X(dict):\n    def __eq__(self, other):\n        return True\nvalue = X()",
    "namedtuple": "P = collections.namedtuple('P', 'x')\nP.__eq__ = lambda self, other: True\nvalue = P(0)",
    "IntEnum": "import enum\nvalue = enum.IntEnum('E', 'a b').b",
    "Decimal": "import decimal\nvalue = decimal.Decimal(2)",
    "in-list": "from unittest import mock\nvalue = [mock.ANY]",
    "in-set": "class X:\n    __eq__ = lambda self, other: True\n    __hash__ = lambda self: 0\nvalue = {X()}",
    "in-dict-key": "class X:\n    __eq__ = lambda self, other: True\n    __hash__ = lambda self: 0\nvalue = {X(): 2}",
}


@pytest.mark.parametrize("test", [CallTest("f", [1], 2), AssertTest("assert f(1) == 2")], ids=["call", "assert"])
@pytest.mark.parametrize("make", EQUAL_TO_ANYTHING.values(), ids=EQUAL_TO_ANYTHING.keys())
def test_values_outside_plain_data_score_zero(make, test):
    program = "import collections\n" + make + "\ndef f(x):\n    return value\n"
    result = run_test(program, test, FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "not plain data" in result.detail, result


@pytest.mark.parametrize(
    "program, test",
    [
        ("def f():\n    return 10 ** 20\n", CallTest("f", [], 10**20 + 1)),
        ("def f():\n    return float(10 ** 18)\n", CallTest("f", [], 10**18 + 1)),
        ("def f():\n    return True\n", CallTest("f", [], 1)),
        ("def f():\n    return 1\n", CallTest("f", [], True)),
        ("def f():\n    return [True, 2]\n", CallTest("f", [], [1, 2])),
        ("def f():\n    return 10 ** 30\n", AssertTest("assert f() == 10 ** 30 + 1")),
        ("print(10 ** 20)", StdioTest("", str(10**20 + 1))),
        ("print(True)", StdioTest("", "1")),
        ("print(1000404.0)", StdioTest("", "1000405")),
    ],
    ids=[
        "big-int-call",
        "float-for-big-int",
        "True-for-1",
        "1-for-True",
        "True-in-list",
        "big-int-assert",
        "big-int-stdio",
        "True-stdio",
        "near-float-for-int-stdio",
    ],
)
def test_near_misses_score_zero(program, test):
    assert run_test(program, test, FAST).status is CaseStatus.WRONG_ANSWER


@pytest.mark.parametrize(
    "got, expected, same",
    [
        (10**20, 10**20 + 1, False),
        (10**20, 10**20, True),
        (2**64 + 1, float(2**64), True),  # an expected float: the float tolerance
        (float(10**18), 10**18 + 1, False),
        (2.0, 2, True),
        (2.0000001, 2, False),  # an expected int: exact
        (10**400, 1.0, False),  # too large for a float
        (True, 1, False),
        (1, True, False),
        (False, 0, False),
        (True, True, True),
        (0.30000000000000004, 0.3, True),
        (0.3001, 0.3, False),
        (2, 2.0000001, True),
        (float("nan"), float("nan"), False),
        ([1, (2, 3)], [1, [2, 3]], True),
        ((1, 2), [1, 2], True),
        ([1], [1, 2], False),
        ({1: "a", None: 2}, {"1": "a", "null": 2}, True),
        ({1: "a", "1": "b"}, {"1": "a"}, False),
        ({1, 2}, [1, 2], False),
        ({1, 2}, {2, 1}, True),
        ("1", 1, False),
        (None, None, True),
        (None, 0, False),
        (b"x", "x", False),
    ],
)
def test_call_results_compare_by_type(got, expected, same):
    assert verdicts.same_value(got, expected) is same


@pytest.mark.parametrize(
    "got, expected, same",
    [
        ("1000404.0", "1000405", False),
        ("1000404.9999999", "1000405", False),  # an expected int: exact
        ("1000405.0", "1000405", True),
        ("1.000405e6", "1000405", True),
        ("1000405", "1000405", True),
        ("1000404.5", "1000405.0", True),
        ("1000403", "1000405.0", False),  # an expected float: within 1e-6
        ("0.333333333", "0.3333333333", True),
        ("1", "1.0000001", True),
        ("1.0000001", "1", False),
        ("0", "1e-7", True),
        ("1e-7", "0", False),
        ("1e9999999", "0.5", False),
        ("-1e9999999", "1e5", False),
        ("1e-9999999", "0.0", True),  # beyond Decimal's range
    ],
)
def test_stdio_numbers_take_the_tolerance_only_for_an_expected_float(got, expected, same):
    assert verdicts.same_stdout(f"{got}\n", expected) is same


PLAIN = [
    None,
    True,
    False,
    0,
    -7,
    10**400,
    -(2**100),
    0.1,
    -0.0,
    float("inf"),
    1e-310,
    complex(1, -2),
    "",
    "é\ud800",
    b"\x00\xff",
    [1, [2]],
    (1, (2,)),
    {"a": [1], 2: None, (1, 2): 3},
    {1, "a"},
    frozenset({(1, 2)}),
    collections.Counter("aab"),
    collections.OrderedDict([(2, 1), (1, 2)]),
    collections.deque([1, 2]),
]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_data_crosses_by_value_exactly(value):
    from gppo.rewards import _wire

    back = _wire.untag(json.loads(json.dumps(_wire.tag(value))))
    assert type(back) is type(value) and repr(back) == repr(value)


def test_nan_and_iterators_cross():
    from gppo.rewards import _wire

    assert math.isnan(_wire.untag(_wire.tag(float("nan"))))
    items = _wire.untag(_wire.tag(i * i for i in range(3)))
    assert iter(items) is items and list(items) == [0, 1, 4]


@pytest.mark.parametrize(
    "node",
    [
        "x",
        [],
        ["int"],
        ["int", 5],
        ["int", "zz"],
        ["bool", 1],
        ["str", 5],
        ["list", "ab"],
        ["dict", [[["list", []], ["none"]]]],
        ["dict", [["none"]]],
        ["object", []],
        ["none", 1],
        ["float", "1e5x"],
        ["set", [["list", []]]],
    ],
    ids=repr,
)
def test_anything_else_is_not_plain_data(node):
    from gppo.rewards import _wire

    with pytest.raises(_wire.NotPlain):
        _wire.untag(node)


def test_a_stdio_verdict_is_the_output_and_the_exit_status():
    """No harness record vouches for a stdin/stdout program: its output and exit status 0 are its
    answer, however it ends (it cannot know the expected output)."""
    for program in (
        "import os, sys\nprint(2)\nsys.stdout.flush()\nos._exit(0)\n",
        "import atexit\natexit.register(print, 2)\n",
    ):
        assert run_test(program, STDIO, FAST).status is CaseStatus.PASSED
    assert run_test("print(2)\nraise SystemExit(3)\n", STDIO, FAST).status is CaseStatus.RUNTIME_ERROR


def test_assert_tests_run_outside_the_program_and_call_it_by_value():
    """The test's names are the prelude's and the program's; a program's exception reaches the test
    as the built-in of that name, so tests that expect an error still work."""
    program = (
        "import sys\nLIMIT = 3\nclass Solution:\n    def f(self, x):\n        return x * LIMIT\n"
        "def g(x):\n    if x < 0:\n        raise ValueError('negative')\n    return sys.version_info[0]\n"
    )
    test_code = (
        "import sys\nassert Solution().f(2) == 6 and LIMIT == 3\nassert g(1) == 3\n"
        "try:\n    g(-1)\n    assert False\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
        "assert 'solution' not in sys.modules and List[int] is not None\n"
    )
    result = run_test(program, AssertTest(test_code), FAST)
    assert result.status is CaseStatus.PASSED, result


def test_a_failed_call_fails_the_test_even_when_the_test_swallows_it():
    program = "import os\ndef f(x):\n    os._exit(0)\n"
    test_code = "try:\n    f(1)\nexcept BaseException:\n    pass\n"
    result = run_test(program, AssertTest(test_code), FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "ended" in result.detail, result


def test_the_sandbox_starts_from_a_venv_in_a_private_directory(isolation, tmp_path):
    """The project cloned into a `mktemp -d` folder (mode 0700) with its venv there: the private
    root must still show the interpreter (it once covered /tmp first, then could not reach the
    folder: "mount tmpfs on /tmp/<folder>: No such file or directory")."""
    private = Path(tempfile.mkdtemp())  # 0700, under /tmp
    try:
        assert os.stat(private).st_mode & 0o777 == 0o700
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(private / "venv")], check=True)
        package_root = Path(sandbox.__file__).parents[2]
        script = (
            "import sys, types\n"
            f"for name, path in (('gppo', {str(package_root / 'gppo')!r}),\n"
            f"                   ('gppo.rewards', {str(package_root / 'gppo' / 'rewards')!r})):\n"
            "    module = types.ModuleType(name)\n    module.__path__ = [path]\n    sys.modules[name] = module\n"
            "from gppo.rewards import code\n"
            f"if {isolation!r} == 'namespaces':\n    code._isolation = lambda: ('namespaces', None)\n"
            "result = code.run_test('import sys\\nprint(sys.executable)', code.StdioTest('', sys.executable),\n"
            "                       code.Limits(timeout_s=5))\n"
            "print(result.status.value, result.isolation, result.detail)\n"
        )
        out = subprocess.run([str(private / "venv/bin/python"), "-c", script], capture_output=True, text=True)
        assert out.stdout.split()[:2] == ["passed", isolation], out.stdout + out.stderr
    finally:
        shutil.rmtree(private)


# ---------------------------------------------------------------------------------------------
# Programs run as scripts (the python tool): run_program, and the pool's servers

AS_SCRIPTS = {
    "print": "print(6 * 7)",
    "exception": "print('partial')\nraise ValueError('bad value')",
    "exit-status": "import sys\nprint('x')\nsys.exit(3)",
    "exit-message": "raise SystemExit('bye')",
    "exit-zero": "import os, sys\nprint(1)\nsys.stdout.flush()\nos._exit(0)",
    "stdin": "print(input())",
    "thread": "import threading\nthreading.Thread(target=lambda: print('from a thread')).start()",
    "atexit": "import atexit\natexit.register(print, 'at exit')",
    "unclosed": "import os\nout = os.fdopen(os.dup(1), 'w')\nout.write('unflushed')",
    "timeout": "while True:\n    pass",
    "memory": "x = bytearray(10 * 1024 ** 3)",
    "output": "while True:\n    print('x' * 1000)",
    "fork-bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
}
SCRIPT_LIMITS = Limits(timeout_s=2, memory_mb=512, max_output_bytes=1 << 16, max_processes=32)


@pytest.fixture(scope="module")
def program_pool():
    with ProgramPool(workers=2) as pool:
        yield pool


@pytest.mark.parametrize("program", AS_SCRIPTS.values(), ids=AS_SCRIPTS.keys())
def test_the_pool_runs_programs_as_run_program_does(program, program_pool, monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation", lambda: ("namespaces", None))
    alone = sandbox.run_program(program, SCRIPT_LIMITS)
    pooled = program_pool.run(program, SCRIPT_LIMITS)
    assert pooled.isolation == alone.isolation == "namespaces" and program_pool.servers == 2
    assert (pooled.status, pooled.stdout[:100], pooled.reason) == (alone.status, alone.stdout[:100], alone.reason)


def test_a_failed_run_gives_its_reason_apart_from_its_output():
    """What the tool layer shows after the output, and makes room for."""
    failed = sandbox.run_program(AS_SCRIPTS["exception"], SCRIPT_LIMITS)
    assert (failed.status, failed.stdout, failed.reason) == (
        CaseStatus.RUNTIME_ERROR,
        "partial\n",
        "ValueError: bad value",
    )
    slow = sandbox.run_program(AS_SCRIPTS["timeout"], Limits(timeout_s=1))
    assert slow.reason == "timeout: wall-clock limit of 1 s"
    assert sandbox.run_program("print('fine')", SCRIPT_LIMITS).reason == ""
    long = sandbox.ProgramRun(CaseStatus.RUNTIME_ERROR, "", "Error: " + "x " * 400 + "\n\n")
    assert len(long.reason) == 300 and "\n" not in long.reason


def test_each_call_in_the_pool_starts_fresh(program_pool):
    """A call is a fork of the server, not of the previous call: nothing a program changed,
    wrote or seeded is there for the next."""
    program = (
        "import builtins, json, os, random\n"
        f"print(random.random(), os.listdir('.'), sorted(os.listdir('/tmp')) == {runtime_in_tmp()!r}, "
        "hasattr(json, 'mark'), hasattr(builtins, 'mark'))\n"
        "json.mark = builtins.mark = True\n"
        "open('left', 'w').close()\nopen('/tmp/left', 'w').close()\n"
    )
    outputs = [program_pool.run(program, FAST).stdout.split() for _ in range(4)]
    assert len({o[0] for o in outputs}) == 4, outputs  # the random module is seeded afresh
    assert all(o[1:] == ["[]", "True", "False", "False"] for o in outputs), outputs


def test_the_pool_is_thread_safe_and_closes_cleanly():
    from concurrent.futures import ThreadPoolExecutor

    before = sandbox_processes()
    with ProgramPool(workers=3) as pool, ThreadPoolExecutor(8) as threads:
        outputs = list(
            threads.map(lambda i: pool.run(f"import time\ntime.sleep(0.05)\nprint({i} ** 2)", FAST), range(24))
        )
        assert [o.stdout for o in outputs] == [f"{i**2}\n" for i in range(24)] and pool.servers == 3
    assert sandbox_processes() - before == set()
    assert zombie_children() == []
    assert not os.path.exists(pool._directory)
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.run("print(1)")


def test_the_pool_falls_back_to_run_program_when_a_server_fails(monkeypatch):
    def broken(self, files, backstop_s):
        raise OSError("no namespaces here")

    monkeypatch.setattr(_Server, "call", broken)
    with ProgramPool(workers=2) as pool:
        with pytest.warns(RuntimeWarning, match="no namespaces here"):
            first = pool.run("print(6 * 7)", FAST)
        assert first.stdout == "42\n" and first.isolation == sandbox._isolation()[0] and pool.servers == 1
    with pytest.raises(ValueError, match="workers must be a positive int"):
        ProgramPool(workers=0)


def test_a_server_that_cannot_start_leaves_its_slot_to_run_program(monkeypatch):
    """The server answers once its namespaces, private root and disabled IPC are made; a slot whose
    server does not (here: its starter cannot be run) goes to run_program from the start."""
    runner = sandbox._RUNNER
    monkeypatch.setattr(sandbox, "_RUNNER", "/nonexistent/_code_runner.py")
    with pytest.warns(RuntimeWarning, match="did not start: .*nonexistent"):
        pool = ProgramPool(workers=2)
    monkeypatch.setattr(sandbox, "_RUNNER", runner)
    with pool:
        assert pool.servers == 0 and pool.run("print(6 * 7)", FAST).stdout == "42\n"


def test_a_pool_without_root_leaves_every_call_to_run_program(monkeypatch):
    """Not root, the pool's programs would be forks of a process holding a user namespace's
    capabilities (no exec drops them): it starts no server, says why once, and still runs programs."""
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.warns(RuntimeWarning, match="not root"):
        pool = ProgramPool(workers=2)
    monkeypatch.undo()
    with pool:
        assert pool.servers == 0 and pool.run("print(6 * 7)", FAST).stdout == "42\n"
