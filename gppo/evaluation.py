"""Evaluate a policy on benchmarks: sample with a `RolloutEngine`, score, write the results.

Protocol: n samples per problem, by default at temperature 0.6 and top-p
0.95. avg@n is the accuracy over the n samples, averaged over problems; pass@k is the unbiased
estimator 1 - C(n-c, k) / C(n, k) (c correct samples out of n), for k in {1, 2, 4, ..., n}; SE is
the standard error of avg@n over problems (sample standard deviation / sqrt(problems), as
lm-evaluation-harness reports it).

Two extractions of a math answer: strict, the format the prompt asks for (the last \\boxed{},
else "the answer is" / "####", judged by math-verify: `gppo.rewards.math`), and, for benchmarks
whose field protocol has it (GSM8K: lm-evaluation-harness's `flexible-extract`), flexible: the
last number in the completion (`flexible_answer`), compared as a number with the reference.
Both are reported side by side.

Progress moves per completion with the token throughput: a live bar in a terminal, a plain line
every 30 s when the output is piped.

Files written to `out_dir`:
- `<benchmark>.jsonl`: one record per problem, appended and flushed as soon as the problem is
  scored, so a crash loses at most the batch being generated. A rerun skips the problems already
  there (and retries those whose scoring failed); a truncated last line is dropped.
- `summary.md` and `summary.csv`: one row per benchmark (also printed as a table, followed by the
  output directory).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gppo.data.benchmarks import Benchmark, BenchmarkProblem, get_benchmark, load_benchmark
from gppo.data.loaders import RowError
from gppo.data.scoring import score
from gppo.prompts import PromptBuilder
from gppo.report import markdown_table, print_table
from gppo.rewards.code import Limits
from gppo.rewards.pipeline import model_text, model_tokens
from gppo.rollout.base import Generation, RolloutEngine, SamplingParams
from gppo.rollout.tools import tool_stats
from gppo.stats import avg_at_k, pass_at_k, standard_error

# lm-evaluation-harness's GSM8K flexible-extract pattern; its last match is the answer.
_NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")


def flexible_answer(text: str) -> str | None:
    """The last number in `text`, read as lm-evaluation-harness's GSM8K `flexible-extract` does
    (last match of `-?[$0-9.,]{2,}|-?[0-9]+`, then ',' and '$' and a final '.' dropped), except
    that a match without a digit ('...') is skipped. None when there is no number."""
    for match in reversed(_NUMBER.findall(text)):
        if any(c.isdigit() for c in match):
            return match.replace(",", "").replace("$", "").removesuffix(".")
    return None


def same_number(answer: str | None, reference: str) -> bool:
    """True when both read as decimal numbers and are equal (18.00 == 18); False otherwise."""
    try:
        return answer is not None and Decimal(answer) == Decimal(reference.replace(",", "").strip())
    except InvalidOperation:
        return False


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


@dataclass
class BenchmarkSummary:
    """Scores of one benchmark; problems whose scoring failed count in `failed`, not in scores."""

    benchmark: str
    problems: int
    n: int
    avg: float  # avg@n, strict extraction
    pass_at: dict[int, float]
    failed: int = 0
    row_errors: list[RowError] = field(default_factory=list)
    avg_se: float = math.nan  # standard error of avg@n over problems
    flexible: float | None = None  # avg@n of the flexible extraction (benchmarks that have one)
    flexible_se: float | None = None


def evaluate(
    engine: RolloutEngine,
    benchmarks: Sequence[str],
    data_files: Mapping[str, str | Path] | None = None,
    n: int | None = None,
    out_dir: str | Path = "runs/eval",
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    prompts: PromptBuilder | None = None,
    from_hub: bool = False,
    limit: int | None = None,
    batch_size: int = 16,
    code_limits: Limits = Limits(),
    math_timeout_s: float = 5.0,
    progress: bool = True,
    console: Console | None = None,
) -> list[BenchmarkSummary]:
    """Sample `n` completions per problem (default: each benchmark's protocol n), score them, and
    write per-problem results and summaries to `out_dir`; returns one summary per benchmark.

    `data_files` maps benchmark names to local files (others need `from_hub=True`).
    `temperature`, `top_p` and `max_tokens` override every benchmark's protocol defaults; `limit`
    keeps the first rows of each benchmark; the engine gets `batch_size` problems at a time. A
    benchmark none of whose rows can be read is a ValueError before any generation.
    `prompts` builds each prompt (chat template, system prompt, prompt template: `gppo.prompts`);
    None sends the problem text as it is. Its settings are part of what a resumed file must match.
    """
    console = console or Console()
    for name, value in (("n", n), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    specs = [get_benchmark(name) for name in benchmarks]  # typos fail before any work
    files = {get_benchmark(name).name: path for name, path in (data_files or {}).items()}
    extra = sorted(set(files) - {b.name for b in specs})
    if extra:
        raise ValueError(
            f"data_files has {extra}, which are not among the benchmarks to evaluate {[b.name for b in specs]}"
        )
    loaded = [load_benchmark(b.name, files.get(b.name), from_hub=from_hub, limit=limit) for b in specs]
    for bench, data in zip(specs, loaded):
        if not data.records:
            first = f" (first: {data.errors[0]})" if data.errors else ""
            raise ValueError(
                f"benchmark {bench.name}: none of its {len(data.errors)} rows could be read{first}; "
                f"give a file in {bench.name}'s public schema"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    summaries = []
    for bench, data in zip(specs, loaded):
        for error in data.errors[:5]:
            console.print(f"[yellow]skipped[/yellow] {error}")
        if len(data.errors) > 5:
            console.print(f"[yellow]skipped[/yellow] {len(data.errors) - 5} more rows of {bench.name}")
        params = SamplingParams(
            temperature=bench.temperature if temperature is None else temperature,
            top_p=bench.top_p if top_p is None else top_p,
            max_new_tokens=bench.max_tokens if max_tokens is None else max_tokens,
            n=bench.n if n is None else n,
            seed=seed,
        )
        path = out / f"{bench.name}.jsonl"
        done = _read_results(path, _sampling(params, prompts))
        todo = [p for p in data.records if p.id not in done]
        with (
            CompletionProgress(
                console, bench.name, params.n * len(data.records), params.n * (len(data.records) - len(todo)), progress
            ) as bar,
            path.open("a", encoding="utf-8") as sink,
        ):
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                chunk_params = replace(params, seed=None if seed is None else seed + start, on_step=bar.on_step)
                texts = [prompts(p.prompt) if prompts else p.prompt for p in chunk]
                generations = engine.generate(texts, chunk_params)
                bar.batch_done(len(generations), sum(model_tokens(g.completion_ids, g.tool_mask) for g in generations))
                for problem, gens in zip(chunk, _by_prompt(generations, len(chunk))):
                    record = _score(bench, problem, gens, _sampling(params, prompts), code_limits, math_timeout_s)
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    os.fsync(sink.fileno())
                    done[problem.id] = record
        records = [done[p.id] for p in data.records if p.id in done]
        summaries.append(_summarize(bench, params.n, records, data.errors))
    _write_summaries(summaries, out, console)
    console.print(
        f"results in {out}/: summary.md, summary.csv, and one <benchmark>.jsonl of per-problem "
        "completions and verdicts",
        soft_wrap=True,
    )
    return summaries


class CompletionProgress:
    """Completions done out of `total`, and generated tokens per second, for one benchmark.

    `on_step` (a `SamplingParams.on_step`) moves it per decoding step; `batch_done` settles the
    counts when `generate` returns (engines that do not report steps move only then). In a
    terminal: a live bar; otherwise (piped, logged) one plain line every `every_s` seconds and one
    at the end, never redrawn or cut to the terminal width."""

    def __init__(
        self, console: Console, name: str, total: int, done: int = 0, enabled: bool = True, every_s: float = 30.0
    ):
        self.console, self.name, self.total, self.done = console, name, total, done
        self.enabled, self.every_s = enabled, every_s
        self.tokens = self.batch_tokens = self.batch_finished = 0
        self.start = self.last_line = time.monotonic()
        self.bar: Progress | None = None

    def __enter__(self) -> CompletionProgress:
        if self.enabled and self.console.is_terminal:
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("completions, {task.fields[rate]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task(self.name, total=self.total, completed=self.done, rate="")
        return self

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-9)

    def on_step(self, tokens: int, finished: int) -> None:
        self.batch_tokens += tokens
        self.batch_finished += finished
        self._show(self.tokens + self.batch_tokens, self.done + self.batch_finished)

    def batch_done(self, completions: int, tokens: int) -> None:
        self.batch_tokens = self.batch_finished = 0
        self.tokens += tokens
        self.done += completions
        self._show(self.tokens, self.done)

    def _show(self, tokens: int, done: int) -> None:
        rate = tokens / max(time.monotonic() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{rate:,.0f} tok/s")
        elif self.enabled and time.monotonic() - self.last_line >= self.every_s:
            self.last_line = time.monotonic()
            self._line(tokens, done, rate)

    def _line(self, tokens: int, done: int, rate: float) -> None:
        elapsed = time.monotonic() - self.start
        self.console.print(
            f"{self.name}: {done}/{self.total} completions, {tokens:,} tokens, {rate:,.0f} tok/s, {elapsed:,.0f} s",
            soft_wrap=True,
            highlight=False,
        )

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.enabled:
            self._line(self.tokens, self.done, self.rate())


def _sampling(params: SamplingParams, prompts: PromptBuilder | None) -> dict:
    """What the results depend on besides the model: sampling and prompt settings."""
    settings = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_new_tokens": params.max_new_tokens,
    }
    if prompts is not None:
        settings.update(
            chat_template=prompts.uses_chat_template,
            system_prompt=prompts.config.system_prompt,
            prompt_template=prompts.config.prompt_template,
        )
    return settings


def _read_results(path: Path, sampling: dict) -> dict[str, dict]:
    """Scored problems already in `path` (failed ones are left out, to be retried)."""
    if not path.exists():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept, done = [], {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if not line.endswith("\n"):
            continue
        if record.get("sampling") != sampling:
            raise ValueError(
                f"{path} holds results sampled with {record.get('sampling')}, not {sampling}: "
                "write to another directory (gppo eval --out DIR) or keep the same sampling and prompt settings"
            )
        kept.append(line)
        if "error" not in record:
            done[record["id"]] = record
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return done


def _by_prompt(generations: list[Generation], prompts: int) -> list[list[Generation]]:
    groups: list[list[Generation]] = [[] for _ in range(prompts)]
    for g in generations:
        groups[g.prompt_index].append(g)
    return groups


def _score(
    bench: Benchmark,
    problem: BenchmarkProblem,
    gens: list[Generation],
    sampling: dict,
    code_limits: Limits,
    math_timeout_s: float,
) -> dict:
    record = {"id": problem.id, "sampling": sampling}
    texts = [g.text for g in gens]
    try:
        if len(gens) != sampling["n"]:
            raise RuntimeError(f"the engine returned {len(gens)} completions instead of n={sampling['n']}")
        results = score(
            bench.kind,
            texts,
            [problem.answer] * len(texts),
            [problem.tests] * len(texts),
            math_timeout_s=math_timeout_s,
            code_limits=code_limits,
        )
        if bench.kind == "math":
            samples = [
                {"reward": r.reward, "verdict": r.verdict.value, "extracted": r.answer, "error": r.error}
                for r in results
            ]
            if bench.flexible:
                for sample, text in zip(samples, texts):
                    answer = flexible_answer(text)
                    sample.update(flexible=answer, flexible_correct=same_number(answer, problem.answer))
        else:
            samples = [
                {
                    "reward": r.reward,
                    "statuses": [c.status.value for c in r.cases],
                    "error": r.error,
                    "detail": next((c.detail for c in r.cases if c.detail), None),
                }
                for r in results
            ]
    except Exception as e:  # one problem's failure must not end the evaluation
        return {**record, "error": f"{type(e).__name__}: {e}"}
    for sample, g in zip(samples, gens):
        sample.update(correct=sample["reward"] >= 1.0, text=g.text, finish_reason=g.finish_reason)
    if bench.kind == "math":
        record["answer"] = problem.answer
    return {**record, "correct": sum(s["correct"] for s in samples), "samples": samples}


def _summarize(bench: Benchmark, n: int, records: list[dict], row_errors: list[RowError]) -> BenchmarkSummary:
    scored = [r for r in records if "error" not in r]
    if not scored:
        return BenchmarkSummary(bench.name, 0, n, float("nan"), {}, len(records) - len(scored), row_errors)
    per_problem = [sum(s["correct"] for s in r["samples"]) / len(r["samples"]) for r in scored]
    pass_at = {k: sum(pass_at_k(n, r["correct"], k) for r in scored) / len(scored) for k in k_values(n)}
    summary = BenchmarkSummary(
        bench.name,
        len(scored),
        n,
        avg_at_k([[p] for p in per_problem]),
        pass_at,
        len(records) - len(scored),
        row_errors,
        standard_error(per_problem),
    )
    if bench.flexible:  # records written before flexible scoring are read from their text
        flexible = [
            sum(s.get("flexible_correct", same_number(flexible_answer(s["text"]), r["answer"])) for s in r["samples"])
            / len(r["samples"])
            for r in scored
        ]
        summary.flexible, summary.flexible_se = sum(flexible) / len(flexible), standard_error(flexible)
    return summary


def _write_summaries(summaries: list[BenchmarkSummary], out: Path, console: Console) -> None:
    ks = sorted({k for s in summaries for k in s.pass_at})
    flexible = any(s.flexible is not None for s in summaries)
    header = (
        ["benchmark", "problems", "bad rows", "failed", "n", "avg@n", "SE"]
        + (["flexible avg@n", "SE"] if flexible else [])
        + [f"pass@{k}" for k in ks]
    )
    rows = [
        [
            s.benchmark,
            str(s.problems),
            str(len(s.row_errors)),
            str(s.failed),
            str(s.n),
            f"{s.avg:.4f}",
            f"{s.avg_se:.4f}",
        ]
        + ([f"{s.flexible:.4f}", f"{s.flexible_se:.4f}"] if s.flexible is not None else ["", ""]) * flexible
        + [f"{s.pass_at[k]:.4f}" if k in s.pass_at else "" for k in ks]
        for s in summaries
    ]
    print_table(
        console,
        "evaluation (avg@n: strict, the format the prompt asks; flexible: the last number)"
        if flexible
        else "evaluation",
        header,
        rows,
    )
    (out / "summary.md").write_text(
        markdown_table(header, [[cell or "-" for cell in row] for row in rows]), encoding="utf-8"
    )
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def evaluate_problems(
    engine: RolloutEngine,
    problems: Sequence,
    verifier,
    prompts: Sequence[str],
    k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    tokenizer=None,
) -> dict[str, float]:
    """Held-out accuracy of problems with a verifier `verifier(problems, completions) -> scores`:
    greedy, and avg@k / pass@k over k samples at `temperature` (used during training and by
    `gppo eval --task`), with the standard errors over problems of greedy and avg@k and the number
    of problems ('eval/problems'). The verifier and eval/length_mean read the model's tokens alone
    (`gppo.rewards.pipeline.model_text`, `model_tokens`): with tools, `tokenizer` decodes them."""

    def texts(gens: list[Generation]) -> list[str]:
        return [model_text(g.text, g.completion_ids, g.tool_mask, tokenizer) for g in gens]

    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed))
    greedy_scores = list(verifier(problems, texts(greedy)))
    sampled = engine.generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=k, seed=seed)
    )
    scores = verifier([problems[g.prompt_index] for g in sampled], texts(sampled))
    per_problem = [scores[i * k : (i + 1) * k] for i in range(len(problems))]
    correct = [sum(s >= 1.0 for s in row) for row in per_problem]
    return {
        "eval/greedy": sum(greedy_scores) / len(problems),
        "eval/greedy_se": standard_error(greedy_scores),
        "eval/avg@k": avg_at_k(per_problem),
        "eval/avg@k_se": standard_error([sum(r) / k for r in per_problem]),
        f"eval/pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(problems),
        "eval/length_mean": sum(model_tokens(g.completion_ids, g.tool_mask) for g in sampled) / len(sampled),
        "eval/problems": len(problems),
        **tool_stats(sampled, "eval/"),
    }


__all__ = [
    "BenchmarkSummary",
    "CompletionProgress",
    "evaluate",
    "evaluate_problems",
    "flexible_answer",
    "k_values",
    "same_number",
]
