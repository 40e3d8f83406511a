"""Evaluation: pass@k and avg@k, and `evaluate` end to end with a stub engine (test only)."""

import csv
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from gppo.evaluation import avg_at_k, evaluate, k_values, pass_at_k
from gppo.rollout.base import Generation

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"

# aime24 fixture: 2+3=5, half of one, 6*7=42; with n=4 the correct counts are 2, 4 and 0
AIME_TEXTS = {
    "$2+3$": ["\\boxed{5}", "The answer is 5.", "\\boxed{6}", "no idea"],
    "half of one": ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", "\\boxed{2/4}"],
    "6 \\cdot 7": ["\\boxed{41}"] * 4,
}


class StubEngine:
    """Returns fixed completions: the texts whose key occurs in the prompt (test only)."""

    max_top_k_logprobs = 0

    def __init__(self, texts: dict[str, list[str]]):
        self.texts = texts
        self.prompts: list[str] = []

    def generate(self, prompts, params):
        self.prompts += prompts
        out = []
        for i, prompt in enumerate(prompts):
            texts = next(v for key, v in self.texts.items() if key in prompt)
            out += [Generation(i, [], [], text) for text in texts[:params.n]]
        return out


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def run(engine, out_dir, benchmarks=("aime24",), files=None, n=4, console=None, **kwargs):
    files = {"aime24": FIXTURES / "aime24.jsonl"} if files is None else files
    return evaluate(engine, list(benchmarks), files, n, out_dir, progress=False, console=console or quiet(),
                    **kwargs)


def test_pass_at_k_matches_the_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_avg_at_k_and_k_values():
    assert avg_at_k([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]) == pytest.approx(0.5)
    assert avg_at_k([[0.5], [1.0]]) == pytest.approx(0.75)
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="at least one problem"):
        avg_at_k([])


def test_avg_and_pass_at_k_on_a_fixture_run(tmp_path):
    [summary] = run(StubEngine(AIME_TEXTS), tmp_path)
    assert (summary.benchmark, summary.problems, summary.n, summary.failed) == ("aime24", 3, 4, 0)
    assert summary.avg == pytest.approx((2 / 4 + 4 / 4 + 0) / 3)
    assert summary.pass_at[1] == pytest.approx(summary.avg)
    assert summary.pass_at[2] == pytest.approx((5 / 6 + 1 + 0) / 3)
    assert summary.pass_at[4] == pytest.approx(2 / 3)
    records = [json.loads(line) for line in (tmp_path / "aime24.jsonl").read_text().splitlines()]
    assert [(r["id"], r["correct"]) for r in records] == [("60", 2), ("61", 4), ("62", 0)]
    assert [s["verdict"] for s in records[0]["samples"]] == ["correct", "correct", "wrong", "unparsable"]
    with (tmp_path / "summary.csv").open() as f:
        [row] = list(csv.DictReader(f))
    assert row["benchmark"] == "aime24" and float(row["pass@4"]) == pytest.approx(2 / 3, abs=1e-4)
    assert "| aime24 | 3 | 0 | 0 | 4 | 0.5000 |" in (tmp_path / "summary.md").read_text()


def test_bad_rows_are_reported_and_the_rest_is_evaluated(tmp_path):
    texts = {"$1+1$": ["\\boxed{2}"], "$3+3$": ["\\boxed{6}"],
             "print the input line": ["```python\nprint(input())\n```"]}
    console = quiet()
    files = {"aime24": FIXTURES / "aime24_bad.jsonl", "livecodebench": FIXTURES / "livecodebench_bad.jsonl"}
    math_summary, code_summary = run(StubEngine(texts), tmp_path, ("aime24", "livecodebench"), files, n=1,
                                     console=console)
    assert (math_summary.problems, len(math_summary.row_errors), math_summary.avg) == (2, 3, 1.0)
    assert (code_summary.problems, len(code_summary.row_errors), code_summary.avg) == (1, 2, 1.0)
    output = console.file.getvalue()
    assert "missing field 'answer'" in output and "bad answer" in output and "func_name" in output


def test_benchmark_typo_fails_before_generating(tmp_path):
    engine = StubEngine(AIME_TEXTS)
    with pytest.raises(ValueError, match="did you mean 'aime24'"):
        run(engine, tmp_path, ("aime2024",), {})
    with pytest.raises(ValueError, match="data_files has \\['amc23'\\]"):
        run(engine, tmp_path, files={"aime24": FIXTURES / "aime24.jsonl", "amc23": FIXTURES / "amc23.jsonl"})
    assert engine.prompts == []


def test_a_problem_whose_scoring_fails_does_not_stop_the_others(tmp_path):
    texts = dict(AIME_TEXTS, **{"half of one": ["\\boxed{0.5}"]})  # too few completions for n=4
    [summary] = run(StubEngine(texts), tmp_path)
    assert (summary.problems, summary.failed) == (2, 1)
    failed = json.loads((tmp_path / "aime24.jsonl").read_text().splitlines()[1])
    assert "returned 1 completions instead of n=4" in failed["error"]
    retry = StubEngine(AIME_TEXTS)
    [summary] = run(retry, tmp_path)  # the failed problem is retried, the others are kept
    assert (summary.problems, summary.failed) == (3, 0) and len(retry.prompts) == 1


def test_resume_skips_scored_problems(tmp_path):
    first = run(StubEngine(AIME_TEXTS), tmp_path, batch_size=1)
    again = StubEngine(AIME_TEXTS)
    assert run(again, tmp_path) == first and again.prompts == []

    path = tmp_path / "aime24.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # a crash in the middle of a write
    resumed = StubEngine(AIME_TEXTS)
    assert run(resumed, tmp_path) == first
    assert len(resumed.prompts) == 2
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["60", "61", "62"]

    with pytest.raises(ValueError, match="holds results sampled with"):
        run(StubEngine(AIME_TEXTS), tmp_path, n=2)
