"""The code sandbox: limits, isolation, judging, the parallel pool, code extraction."""

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gppo.rewards import code as sandbox
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

FAST = Limits(timeout_s=2)
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def sandbox_processes() -> set[int]:
    """Live processes running the sandbox (bootstraps and the programs they forked)."""
    marker = str(Path(sandbox._RUNNER).resolve()).encode()
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/cmdline").read_bytes():
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
    method = ("class Solution:\n    def pair(self, xs: List[int]) -> Tuple[int, int]:\n"
              "        return min(xs), max(xs)\n")
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
    result = run_test("while True:\n    print('x' * 1000)\n", StdioTest("", ""),
                      Limits(timeout_s=5, max_output_bytes=64 * 1024))
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
