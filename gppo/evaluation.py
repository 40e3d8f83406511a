"""Evaluate a policy on benchmarks: sample with a `RolloutEngine`, score, write the results.

Protocol: n samples per problem, by default at temperature 0.6 and top-p
0.95. avg@n is the accuracy over the n samples, averaged over problems; pass@k is the unbiased
estimator 1 - C(n-c, k) / C(n, k) (c correct samples out of n), for k in {1, 2, 4, ..., n}.

Files written to `out_dir`:
- `<benchmark>.jsonl`: one record per problem, appended and flushed as soon as the problem is
  scored, so a crash loses at most the batch being generated. A rerun skips the problems already
  there (and retries those whose scoring failed); a truncated last line is dropped.
- `summary.md` and `summary.csv`: one row per benchmark (also printed as a table).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console
from rich.progress import Progress

from gppo.data.benchmarks import BenchmarkProblem, get_benchmark, load_benchmark
from gppo.data.loaders import RowError
from gppo.prompts import PromptBuilder
from gppo.rewards.code import Limits, score_code
from gppo.report import markdown_table, print_table
from gppo.rewards.math import score_math
from gppo.rollout.base import Generation, RolloutEngine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c correct out of n samples: 1 - C(n-c, k)/C(n, k), as a stable product."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(scores: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean score of each problem's k samples."""
    if not scores or any(len(s) == 0 for s in scores):
        raise ValueError("avg@k needs at least one problem and one sample per problem")
    return sum(sum(s) / len(s) for s in scores) / len(scores)


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
    avg: float  # avg@n
    pass_at: dict[int, float]
    failed: int = 0
    row_errors: list[RowError] = field(default_factory=list)


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
        raise ValueError(f"data_files has {extra}, which are not among the benchmarks to evaluate "
                         f"{[b.name for b in specs]}")
    loaded = [load_benchmark(b.name, files.get(b.name), from_hub=from_hub, limit=limit) for b in specs]
    for bench, data in zip(specs, loaded):
        if not data.records:
            first = f" (first: {data.errors[0]})" if data.errors else ""
            raise ValueError(f"benchmark {bench.name}: none of its {len(data.errors)} rows could be read{first}; "
                             f"give a file in {bench.name}'s public schema")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    summaries = []
    with Progress(console=console, disable=not progress) as bar:
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
            task = bar.add_task(bench.name, total=len(data.records), completed=len(data.records) - len(todo))
            with path.open("a", encoding="utf-8") as sink:
                for start in range(0, len(todo), batch_size):
                    chunk = todo[start:start + batch_size]
                    chunk_params = params if seed is None else replace(params, seed=seed + start)
                    texts = [prompts(p.prompt) if prompts else p.prompt for p in chunk]
                    generations = engine.generate(texts, chunk_params)
                    for problem, gens in zip(chunk, _by_prompt(generations, len(chunk))):
                        record = _score(bench.kind, problem, gens, _sampling(params, prompts), code_limits,
                                        math_timeout_s)
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                        os.fsync(sink.fileno())
                        done[problem.id] = record
                        bar.advance(task)
            records = [done[p.id] for p in data.records if p.id in done]
            summaries.append(_summarize(bench.name, params.n, records, data.errors))
    _write_summaries(summaries, out, console)
    return summaries


def _sampling(params: SamplingParams, prompts: PromptBuilder | None) -> dict:
    """What the results depend on besides the model: sampling and prompt settings."""
    settings = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                "max_new_tokens": params.max_new_tokens}
    if prompts is not None:
        settings.update(chat_template=prompts.uses_chat_template, system_prompt=prompts.config.system_prompt,
                        prompt_template=prompts.config.prompt_template)
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
            raise ValueError(f"{path} holds results sampled with {record.get('sampling')}, not {sampling}: "
                             f"use another out_dir, or the same sampling and prompt settings")
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


def _score(kind: str, problem: BenchmarkProblem, gens: list[Generation], sampling: dict,
           code_limits: Limits, math_timeout_s: float) -> dict:
    record = {"id": problem.id, "sampling": sampling}
    texts = [g.text for g in gens]
    try:
        if len(gens) != sampling["n"]:
            raise RuntimeError(f"the engine returned {len(gens)} completions instead of n={sampling['n']}")
        if kind == "math":
            results = score_math(texts, [problem.answer] * len(texts), timeout_s=math_timeout_s)
            samples = [{"reward": r.reward, "verdict": r.verdict.value, "extracted": r.answer,
                        "error": r.error} for r in results]
        else:
            results = score_code(texts, [problem.tests] * len(texts), limits=code_limits)
            samples = [{"reward": r.reward, "statuses": [c.status.value for c in r.cases], "error": r.error,
                        "detail": next((c.detail for c in r.cases if c.detail), None)} for r in results]
    except Exception as e:  # one problem's failure must not end the evaluation
        return {**record, "error": f"{type(e).__name__}: {e}"}
    for sample, g in zip(samples, gens):
        sample.update(correct=sample["reward"] >= 1.0, text=g.text, finish_reason=g.finish_reason)
    if kind == "math":
        record["answer"] = problem.answer
    return {**record, "correct": sum(s["correct"] for s in samples), "samples": samples}


def _summarize(name: str, n: int, records: list[dict], row_errors: list[RowError]) -> BenchmarkSummary:
    scored = [r for r in records if "error" not in r]
    if not scored:
        return BenchmarkSummary(name, 0, n, float("nan"), {}, len(records) - len(scored), row_errors)
    avg = avg_at_k([[float(s["correct"]) for s in r["samples"]] for r in scored])
    pass_at = {k: sum(pass_at_k(n, r["correct"], k) for r in scored) / len(scored) for k in k_values(n)}
    return BenchmarkSummary(name, len(scored), n, avg, pass_at, len(records) - len(scored), row_errors)


def _write_summaries(summaries: list[BenchmarkSummary], out: Path, console: Console) -> None:
    ks = sorted({k for s in summaries for k in s.pass_at})
    header = ["benchmark", "problems", "bad rows", "failed", "n", "avg@n"] + [f"pass@{k}" for k in ks]
    rows = [[s.benchmark, str(s.problems), str(len(s.row_errors)), str(s.failed), str(s.n), f"{s.avg:.4f}"]
            + [f"{s.pass_at[k]:.4f}" if k in s.pass_at else "" for k in ks] for s in summaries]
    print_table(console, "evaluation", header, rows)
    (out / "summary.md").write_text(markdown_table(header, [[cell or "-" for cell in row] for row in rows]),
                                    encoding="utf-8")
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def evaluate_problems(engine: RolloutEngine, problems: Sequence, verifier, prompts: Sequence[str], k: int,
                      temperature: float, max_new_tokens: int, seed: int) -> dict[str, float]:
    """Held-out accuracy of problems with a verifier `verifier(problems, completions) -> scores`:
    greedy, and avg@k / pass@k over k samples at `temperature` (used during training and by
    `gppo eval --task`)."""
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed))
    greedy_scores = verifier(problems, [g.text for g in greedy])
    sampled = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                      n=k, seed=seed))
    scores = verifier([problems[g.prompt_index] for g in sampled], [g.text for g in sampled])
    per_problem = [scores[i * k:(i + 1) * k] for i in range(len(problems))]
    correct = [sum(s >= 1.0 for s in row) for row in per_problem]
    return {"eval/greedy": sum(greedy_scores) / len(problems), "eval/avg@k": avg_at_k(per_problem),
            f"eval/pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(problems),
            "eval/length_mean": sum(len(g.completion_ids) for g in sampled) / len(sampled)}


__all__ = ["BenchmarkSummary", "avg_at_k", "evaluate", "evaluate_problems", "k_values", "pass_at_k"]
