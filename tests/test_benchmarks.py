"""Benchmark registry and training-data loaders, on small hand-written fixtures in each public schema."""

import base64
import json
import os
import pickle
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from gppo.data.benchmarks import BENCHMARKS, get_benchmark, load_benchmark
from gppo.data.loaders import read_rows
from gppo.rewards.code import AssertTest, CallTest, StdioTest

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"

# benchmark -> (problems in its fixture, first id, first answer or first test)
EXPECTED = {
    "aime24": (3, "60", "5"),
    "aime25": (2, "0", "6"),
    "amc23": (2, "0", "27"),
    "math500": (2, "test/algebra/1.json", "2\\sqrt{2}"),
    "gsm8k": (2, "0", "12"),
    "minerva": (1, "0", "15"),
    "olympiadbench": (2, "1606", "$2,-2$"),
    "livecodebench": (2, "toy001", StdioTest("1 2\n", "3\n")),
    "codeforces": (1, "9999/A", StdioTest("3 5\n", "5\n")),
    "humanevalplus": (
        1,
        "Toy/0",
        AssertTest(
            "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n\n\ncheck(add)\n"
        ),
    ),
}


def test_every_benchmark_has_a_fixture():
    assert set(EXPECTED) == set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_maps_to_problems(name):
    count, first_id, first = EXPECTED[name]
    bench = get_benchmark(name)
    result = load_benchmark(name, FIXTURES / f"{name}.jsonl")
    assert len(result.records) == count
    problem = result.records[0]
    assert problem.id == first_id and problem.kind == bench.kind
    if bench.kind == "math":
        assert problem.answer == first and problem.tests is None
        assert problem.prompt.endswith("\\boxed{}.")
    else:
        assert problem.tests[0] == first and problem.answer is None
        assert "```python" in problem.prompt
    protocol = (0.0, 1.0, 1) if name == "gsm8k" else (0.6, 0.95)  # gsm8k: greedy
    assert (bench.temperature, bench.top_p, bench.n)[: len(protocol)] == protocol and bench.n >= 1


def test_gsm8k_reads_the_answer_after_hashes_and_scores_both_styles():
    """GSM8K's public rows end in '#### N' (thousands separators allowed); a completion may answer
    in a box or after '####', and both verify against the reference."""
    from gppo.rewards.math import score_math

    problems = load_benchmark("gsm8k", FIXTURES / "gsm8k.jsonl").records
    assert [p.answer for p in problems] == ["12", "2,400"]
    assert problems[0].prompt.startswith("Toy question: Ana") and problems[0].prompt.endswith("\\boxed{}.")
    results = score_math(["3 * 4 = 12.\n#### 12", "So \\boxed{2400}.", "#### 2401"], ["12", "2,400", "2,400"])
    assert [r.reward for r in results] == [1.0, 1.0, 0.0]


def test_livecodebench_decodes_private_and_functional_tests():
    stdin, functional = load_benchmark("livecodebench", FIXTURES / "livecodebench.jsonl").records
    # the second test is private, stored as base64(zlib(pickle(JSON)))
    assert stdin.tests == [StdioTest("1 2\n", "3\n"), StdioTest("10 20\n", "30\n")]
    assert functional.tests == [CallTest("double", [4], 8), CallTest("double", [-3], -6)]
    assert "class Solution" in functional.prompt


def test_pickled_tests_may_not_reference_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    row = json.loads((FIXTURES / "livecodebench.jsonl").read_text().splitlines()[0])
    row["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Payload()))).decode()
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    result = load_benchmark("livecodebench", path)
    assert result.records == [] and "refusing to unpickle" in result.errors[0].message
    assert not (tmp_path / "pwned").exists()


def test_bad_rows_are_reported_and_the_rest_load():
    math = load_benchmark("aime24", FIXTURES / "aime24_bad.jsonl")
    assert [p.id for p in math.records] == ["1", "4"]
    messages = [str(e) for e in math.errors]
    assert messages[0] == "aime24 row 1 (id '2'): missing field 'answer' (columns seen: id, problem)"
    assert messages[1].startswith("aime24 row 2 (id '3'): bad answer: math-verify cannot parse")
    assert messages[2] == "aime24 row 4 (id '4'): duplicate id: the earlier row is kept"
    code = load_benchmark("livecodebench", FIXTURES / "livecodebench_bad.jsonl")
    assert [p.id for p in code.records] == ["ok001"]
    assert "must be a list of objects with 'input' and 'output'" in code.errors[0].message
    assert "need 'func_name'" in code.errors[1].message
    codeforces = load_benchmark("codeforces", FIXTURES / "codeforces.jsonl")
    assert "interactive problems are not supported" in codeforces.errors[0].message


def test_benchmark_typo_names_the_closest():
    with pytest.raises(ValueError, match="unknown benchmark 'aime2024' \\(did you mean 'aime24'\\?\\)"):
        get_benchmark("aime2024")
    with pytest.raises(ValueError, match="did you mean 'livecodebench'"):
        load_benchmark("livecodebnch", FIXTURES / "livecodebench.jsonl")
    assert get_benchmark("MATH500").name == "math500"


def test_missing_data_says_how_to_provide_it(capsys):
    hint = r"HuggingFaceH4/aime_2024's schema \(gppo eval --data FILE; in Python data_files=\{'aime24'.*--from_hub"
    with pytest.raises(ValueError, match=hint):
        load_benchmark("aime24")
    from gppo.cli import main

    assert main(["eval", "--model", "unused", "--benchmark", "aime24"]) == 2  # the command speaks its flags
    error = capsys.readouterr().err
    assert "--data" in error and "--from_hub" in error and "data_files" not in error and "from_hub=" not in error


def test_unreachable_hub_says_to_use_a_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = replace(BENCHMARKS["aime24"], hub_id="gppo-tests/not-a-dataset")
    monkeypatch.setitem(BENCHMARKS, "aime24", missing)
    with pytest.raises(ValueError, match=r"could not load gppo-tests/not-a-dataset .* pass the local file"):
        load_benchmark("aime24", from_hub=True)


def test_parquet_and_json_files(tmp_path):
    pyarrow, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = read_rows(FIXTURES / "math500.jsonl")
    parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "math500.parquet")
    (tmp_path / "math500.json").write_text(json.dumps(rows))
    for path in (tmp_path / "math500.parquet", tmp_path / "math500.json"):
        assert [p.answer for p in load_benchmark("math500", path).records] == ["2\\sqrt{2}", "(-1,1)"]


def test_unreadable_files_are_clear_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"problem": "x", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"could not read .*bad.jsonl: ArrowInvalid: JSON parse error"):
        read_rows(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"unsupported data file type '.txt' .*save_to_disk directory"):
        (tmp_path / "x.txt").write_text("a,b\n")
        read_rows(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
