"""The summary of `gppo sweep` (described in gppo.commands.sweep's docstring): `Job`, one run, and the
per-run and per-cell statistics over seeds, paired contrasts, and the tables and files that show them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gppo.commands.sweep_plots import plot_heatmap, plus_minus
from gppo.report import fmt, markdown_table, write_csv
from gppo.stats import mean_ci
from gppo.trainer import TrainConfig
from gppo.trainer.logging import MetricsLog

LAST_STEPS = 10  # window of the end-of-run averages (masked fraction, entropy, mismatch)


@dataclass(frozen=True)
class Job:
    """One run of the sweep: the cell it belongs to, its seed and its full configuration."""

    cell: str
    seed: int
    config: TrainConfig


def run_stats(run_dir: Path, target: float | None) -> dict:
    """The per-run numbers of the summary (see the docstring of gppo.commands.sweep), from metrics.jsonl."""
    records = MetricsLog(run_dir / "metrics.jsonl", [], {}).read()
    evals = [r for r in records if "eval/avg@k" in r]
    if not evals:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no evaluation")
    steps = np.array([r["step"] for r in evals], dtype=np.float64)
    avg = np.array([r["eval/avg@k"] for r in evals])
    auc = float(avg[0]) if len(evals) == 1 else float(np.trapezoid(avg, steps) / (steps[-1] - steps[0]))
    reached = [r["step"] for r in evals if target is not None and r["eval/avg@k"] >= target]
    last = [r for r in records if r["step"] > 0][-LAST_STEPS:]

    def tail_mean(key):
        values = [r[key] for r in last if key in r]
        return float(np.mean(values)) if values else math.nan

    return {
        "greedy": evals[-1]["eval/greedy"],
        "avg_at_k": evals[-1]["eval/avg@k"],
        "auc": auc,
        "start_greedy": evals[0]["eval/greedy"],
        "start_avg_at_k": evals[0]["eval/avg@k"],
        "steps_to_target": reached[0] if reached else None,
        "masked_frac": tail_mean("loss/masked_frac"),
        "entropy": tail_mean("loss/entropy"),
        "mismatch_kl": tail_mean("mismatch/kl_k3"),
        "train_seconds": float(sum(r.get("perf/step_seconds", 0.0) for r in records)),
    }


def seed_stats(jobs: list[Job], target: float | None) -> dict[str, dict[int, dict]]:
    """cell -> seed -> `run_stats` of every finished run."""
    out: dict[str, dict[int, dict]] = {job.cell: {} for job in jobs}
    for job in jobs:
        if (job.config.run_dir() / "summary.json").is_file():
            out[job.cell][job.seed] = run_stats(job.config.run_dir(), target)
    return out


def summarize(jobs: list[Job], target: float | None, per_seed: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per cell over its finished seeds (`seed_stats`), with the exact radii it used."""
    rows = []
    for cell in dict.fromkeys(job.cell for job in jobs):
        cell_jobs = [j for j in jobs if j.cell == cell]
        loss = cell_jobs[0].config.gppo_config()
        stats = list(per_seed[cell].values())
        row = {
            "cell": cell,
            "preset": cell_jobs[0].config.preset,
            "divergence": loss.divergence,
            "estimator": loss.estimator,
            "rule": loss.rule,
            "delta_low": loss.delta_low if loss.uses_estimate else None,
            "delta_high": loss.delta_high if loss.uses_estimate else None,
            "seeds": len(stats),
        }
        for key in ("greedy", "avg_at_k", "auc"):
            row[key], row[f"{key}_ci"] = mean_ci([s[key] for s in stats])
        hits = [s["steps_to_target"] for s in stats if s["steps_to_target"] is not None]
        row["steps_to_target"] = float(np.mean(hits)) if hits else None
        row["target_reached"] = f"{len(hits)}/{len(stats)}" if target is not None else None
        for key in ("start_greedy", "start_avg_at_k", "masked_frac", "entropy", "mismatch_kl", "train_seconds"):
            row[key] = mean_ci([s[key] for s in stats])[0]
        rows.append(row)
    return rows


CONTRAST_METRICS = ("avg_at_k", "auc", "greedy")


def contrasts(
    per_seed: dict[str, dict[int, dict]], points: dict[str, tuple[str, str]] | None, baseline: str
) -> list[dict]:
    """Paired contrasts (gppo.commands.sweep's docstring): kind 'cell' for every pair of cells (a
    before b in cell order), and for a grid (`points`: cell -> (divergence, estimator)) kinds
    'divergence' and 'estimator', each level against the baseline's, averaged over the other axis."""
    rows = []

    def add(kind: str, a: str, b: str, pairs: list[tuple[str, str]]) -> None:
        seeds = sorted(set.intersection(*(set(per_seed[x]) & set(per_seed[y]) for x, y in pairs)))
        for metric in CONTRAST_METRICS:
            d = [float(np.mean([per_seed[x][s][metric] - per_seed[y][s][metric] for x, y in pairs])) for s in seeds]
            d = [v for v in d if math.isfinite(v)]
            diff, ci = mean_ci(d)
            rows.append(
                {
                    "kind": kind,
                    "a": a,
                    "b": b,
                    "metric": metric,
                    "pairs": len(d),
                    "diff": diff,
                    "ci": ci,
                    "significant": math.isfinite(ci) and abs(diff) > ci,
                }
            )

    cells = list(per_seed)
    for i, a in enumerate(cells):
        for b in cells[i + 1 :]:
            add("cell", a, b, [(a, b)])
    if points:
        cell_at = {point: cell for cell, point in points.items()}
        base = points[baseline]
        for kind, axis in (("divergence", 0), ("estimator", 1)):
            for level in dict.fromkeys(point[axis] for point in cell_at):
                if level == base[axis]:
                    continue
                pairs = []
                for point, cell in cell_at.items():
                    reference = (base[0], point[1]) if axis == 0 else (point[0], base[1])
                    if point[axis] == level and reference in cell_at:
                        pairs.append((cell, cell_at[reference]))
                if pairs:
                    add(kind, level, base[axis], pairs)
    return rows


def contrast_table(rows: list[dict], baseline: str) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells: every cell minus the baseline, then the main effects, each
    metric as difference ± 95% half width (* where the interval excludes 0)."""
    header = ["contrast", "seeds"] + [f"Δ {m}" for m in CONTRAST_METRICS]
    table: dict[str, dict] = {}
    for r in rows:
        if r["kind"] == "cell":
            if baseline not in (r["a"], r["b"]):
                continue
            sign, label = (-1, f"{r['b']} − {baseline}") if r["a"] == baseline else (1, f"{r['a']} − {baseline}")
        else:
            sign, label = 1, f"{r['kind']} {r['a']} − {r['b']}"
        entry = table.setdefault(label, {"seeds": str(r["pairs"])})
        mark = " *" if r["significant"] else ""
        entry[r["metric"]] = f"{sign * r['diff']:+.3f} ± {fmt(r['ci'], missing='?')}{mark}" if r["pairs"] else ""
    return header, [[label, e["seeds"]] + [e.get(m, "") for m in CONTRAST_METRICS] for label, e in table.items()]


def _start_end(row: dict, key: str) -> str:
    """'start → end ± ci' of a held-out accuracy (empty for a cell with no finished seed)."""
    return f"{fmt(row[f'start_{key}'])} → {plus_minus(row, key)}" if row["seeds"] else ""


def display_rows(rows: list[dict], target: float | None) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of the summary table (shared by sweep.md and the console)."""
    header = [
        "cell",
        "rule",
        "δ low / high",
        "seeds",
        "greedy start → end",
        "avg@k start → end",
        "AUC avg@k",
        f"steps to {target:g}" if target is not None else "steps to target",
        "masked",
        "entropy",
        "KL(mu‖pi_old)",
        "train s",
    ]
    body = []
    for r in rows:
        steps = (
            ""
            if target is None
            else (
                f"{r['steps_to_target']:.0f} ({r['target_reached']})"
                if r["steps_to_target"] is not None
                else "not reached"
            )
        )
        delta = f"{r['delta_low']:.4g} / {r['delta_high']:.4g}" if r["delta_low"] is not None else ""
        body.append(
            [
                r["cell"],
                r["rule"],
                delta,
                str(r["seeds"]),
                _start_end(r, "greedy"),
                _start_end(r, "avg_at_k"),
                plus_minus(r, "auc"),
                steps,
                fmt(r["masked_frac"]),
                fmt(r["entropy"]),
                fmt(r["mismatch_kl"], ".3g"),
                fmt(r["train_seconds"], ".1f"),
            ]
        )
    return header, body


def write_summary(
    rows: list[dict],
    paired: list[dict],
    baseline: str,
    out: Path,
    target: float | None,
    note: str,
    heatmap_title: str | None,
) -> None:
    """sweep.csv (exact numbers), contrasts.csv, sweep.md (the formatted tables) and, given a
    title, heatmap.png."""
    write_csv(rows, out / "sweep.csv")
    if paired:
        write_csv(paired, out / "contrasts.csv")
    text = f"# gppo sweep: {out}\n\n{note}\n\n" + markdown_table(*display_rows(rows, target))
    if paired:
        text += (
            f"\n## Paired contrasts against {baseline}\n\nPer-seed differences (same seeds), mean ± 95% "
            "t half width; * where the interval excludes 0. All pairs: contrasts.csv.\n\n"
            + markdown_table(*contrast_table(paired, baseline))
        )
    (out / "sweep.md").write_text(text)
    finished = [r for r in rows if r["seeds"]]
    if heatmap_title and finished:
        plot_heatmap(finished, out / "heatmap.png", heatmap_title)
