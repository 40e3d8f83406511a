"""Evaluation: pass@k and avg@k, and `evaluate` end to end with a stub engine (test only)."""

import csv
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from gppo.evaluation import evaluate, flexible_answer, k_values, same_number
from gppo.rollout.base import Generation, SamplingParams
from gppo.stats import avg_at_k, pass_at_k, standard_error

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
            out += [Generation(i, [], [], text) for text in texts[: params.n]]
        return out


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def run(engine, out_dir, benchmarks=("aime24",), files=None, n=4, console=None, **kwargs):
    files = {"aime24": FIXTURES / "aime24.jsonl"} if files is None else files
    return evaluate(engine, list(benchmarks), files, n, out_dir, progress=False, console=console or quiet(), **kwargs)


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
    texts = {
        "$1+1$": ["\\boxed{2}"],
        "$3+3$": ["\\boxed{6}"],
        "print the input line": ["```python\nprint(input())\n```"],
    }
    console = quiet()
    files = {"aime24": FIXTURES / "aime24_bad.jsonl", "livecodebench": FIXTURES / "livecodebench_bad.jsonl"}
    math_summary, code_summary = run(
        StubEngine(texts), tmp_path, ("aime24", "livecodebench"), files, n=1, console=console
    )
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


# ------------------------------------------------------------------ strict and flexible extraction (issue 19)
def test_flexible_answer_reads_the_last_number_as_the_harness_does():
    # lm-evaluation-harness's flexible-extract: last match of -?[$0-9.,]{2,}|-?[0-9]+, then ',' '$' and a final '.'
    # dropped; expectations written by hand from that rule.
    cases = {
        "So, the answer is 26%": "26",
        "She pays $1,234.50.": "1234.50",
        "3 boxes of 4 pens: 12 pens": "12",
        "It drops to -7 degrees": "-7",
        "no number here": None,
        "7 apples ...": "7",
        "x = 2.": "2",
    }
    for text, expected in cases.items():
        assert flexible_answer(text) == expected, text
    assert same_number("2400", "2,400") and same_number("18.00", "18") and not same_number("17", "18")
    assert not same_number(None, "18") and not same_number("3..", "3") and not same_number("12", "\\frac{1}{2}")


def test_standard_error_is_the_sample_sd_over_sqrt_n():
    values = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(values) / 5
    by_hand = math.sqrt(sum((v - mean) ** 2 for v in values) / 4) / math.sqrt(5)
    assert standard_error(values) == pytest.approx(by_hand) and math.isnan(standard_error([1.0]))


GSM8K_TEXTS = {  # strict needs \boxed{} / "the answer is" / ####; flexible takes the last number
    "3 boxes of 4 pens": ["She has 12 pens. So, the answer is 12."],  # strict: "the answer is" reads 12
    "800 cups": ["Tuesday 1600, so 2,400 cups were sold"],  # no marker: only flexible finds 2400
}


def test_gsm8k_reports_strict_and_flexible_side_by_side(tmp_path):
    console = quiet()
    [summary] = run(
        StubEngine(GSM8K_TEXTS), tmp_path, ("gsm8k",), {"gsm8k": FIXTURES / "gsm8k.jsonl"}, n=None, console=console
    )
    assert (summary.problems, summary.n) == (2, 1)
    assert summary.avg == pytest.approx(0.5) and summary.flexible == pytest.approx(1.0)
    assert summary.avg_se == pytest.approx(standard_error([1.0, 0.0])) and summary.flexible_se == 0.0
    records = [json.loads(line) for line in (tmp_path / "gsm8k.jsonl").read_text().splitlines()]
    assert [s["flexible"] for r in records for s in r["samples"]] == ["12", "2400"]
    assert [r["sampling"]["max_new_tokens"] for r in records] == [256, 256]  # the harness's generation length
    header = (tmp_path / "summary.md").read_text().splitlines()[0]
    assert "| avg@n | SE | flexible avg@n | SE |" in header
    assert f"results in {tmp_path}/" in console.file.getvalue()
    # a file written before flexible scoring (no 'flexible_correct') is scored from its text on resume
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {**r, "samples": [{k: v for k, v in s.items() if not k.startswith("flexible")} for s in r["samples"]]}
            )
            + "\n"
            for r in records
        )
    )
    [again] = run(StubEngine({}), tmp_path, ("gsm8k",), {"gsm8k": FIXTURES / "gsm8k.jsonl"}, n=None)
    assert again.flexible == pytest.approx(1.0)


def test_other_math_benchmarks_have_no_flexible_column(tmp_path):
    [summary] = run(StubEngine(AIME_TEXTS), tmp_path)
    assert summary.flexible is None and "flexible" not in (tmp_path / "summary.md").read_text()


# ------------------------------------------------------------------ progress per completion (issue 19)
class SteppingEngine(StubEngine):
    """A stub that reports every decoding step as the HF engine does: each completion is one token a
    step long, the i-th ends at step i (test only)."""

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        for step in range(len(out)):
            params.on_step(len(out) - step, 1)
        return [Generation(g.prompt_index, [], [0] * (i + 1), g.text) for i, g in enumerate(out)]


def test_piped_progress_moves_per_completion_with_throughput_and_is_not_cut(tmp_path):
    console = Console(file=io.StringIO(), width=40)  # not a terminal: plain lines
    from gppo.evaluation import CompletionProgress

    with CompletionProgress(console, "aime24", total=12, enabled=True, every_s=0.0) as bar:
        engine = SteppingEngine(AIME_TEXTS)
        generations = engine.generate(["$2+3$", "half of one", "6 \\cdot 7"], SamplingParams(n=4, on_step=bar.on_step))
        bar.batch_done(len(generations), sum(len(g.completion_ids) for g in generations))
    lines = console.file.getvalue().splitlines()
    done = [int(line.split(": ")[1].split("/")[0]) for line in lines]
    assert done[:12] == list(range(1, 13)) and done[-1] == 12  # one line per finished completion, then the total
    assert all(line.startswith("aime24: ") and "tok/s" in line for line in lines)  # 40 columns, yet not cut
    assert "78 tokens" in lines[-1]  # 1 + 2 + ... + 12 tokens


def test_hf_engine_reports_each_step(micro_model):
    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout.hf import HFEngine

    model, tokenizer = load_model_and_tokenizer(micro_model)
    calls = []
    gens = HFEngine(model, tokenizer).generate(
        ["12+34=", "5+6="], SamplingParams(n=3, max_new_tokens=6, seed=0, on_step=lambda *a: calls.append(a))
    )
    assert sum(tokens for tokens, _ in calls) == sum(len(g.completion_ids) for g in gens)
    assert sum(finished for _, finished in calls) == 6
