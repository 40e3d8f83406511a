"""Which trust regions hold as staleness grows: the summary of a grid of `gppo sweep`s, each method
asynchronous with partial rollouts at `--max_staleness S` (wave by wave, and with continuous
batching where its sweeps exist) and with today's fixed lag `--off_policy_steps S`
(docs/results.md §21, §22).

The grid, one sweep directory per regime and level under ROOT (grpo clipped at a recomputed π_old
is `grpo --anchor old`, a sweep of its own since `--anchor` applies to a whole sweep):

    for S in 1 4 8; do
      A="--async_rollouts true --async_batching waves --partial_rollouts true --max_staleness $S"
      gppo sweep --task countdown --seeds 0 1 2 3 4 --presets dppo-binary-tv dppo-topk-kl cispo icepop \
          pg-is minirl $A --out ROOT/async-s$S
      gppo sweep --task countdown --seeds 0 1 2 3 4 --presets grpo --anchor old $A --out ROOT/async-s$S-grpo-old
      gppo sweep --task countdown --seeds 0 1 2 3 4 --presets dppo-binary-tv dppo-topk-kl cispo icepop \
          pg-is minirl --off_policy_steps $S --out ROOT/off-$S
      gppo sweep --task countdown --seeds 0 1 2 3 4 --presets grpo --anchor old --off_policy_steps $S \
          --out ROOT/off-$S-grpo-old
    done
    # continuous batching (optional): as the async sweeps with --async_batching groups, into
    # ROOT/groups-s$S and ROOT/groups-s$S-grpo-old
    python benchmarks/staleness_learning.py ROOT

Per (regime, S, method): final held-out avg@k and its AUC over the run (mean ± 95% t-interval over
seeds), the end-of-run KL(μ‖π_old) and masked fraction, the versions behind per token and the versions per completion; then
paired by seed: each method against grpo in the same cell, each method's asynchronous run against
its fixed-lag run, continuous batching against waves, and S = 8 against S = 1 within each regime. Finished runs only (summary.json);
a cell with fewer seeds pairs on the seeds both sides have.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gppo.commands.sweep_stats import run_stats
from gppo.report import fmt, markdown_table
from gppo.stats import mean_ci

METHODS = ("grpo-old", "dppo-binary-tv", "dppo-topk-kl", "cispo", "icepop", "pg-is", "minirl")
REGIMES = {"async": "async-s{s}", "async groups": "groups-s{s}", "fixed lag": "off-{s}"}


def runs_of(root: Path, regime: str, staleness: int, method: str) -> dict[int, Path]:
    """seed -> finished run directory of one cell."""
    directory = root / REGIMES[regime].format(s=staleness)
    preset = method
    if method == "grpo-old":
        directory, preset = directory.with_name(directory.name + "-grpo-old"), "grpo"
    found = {}
    for run in sorted(directory.glob(f"{preset}-s*")):
        seed = run.name.removeprefix(f"{preset}-s")
        if seed.isdigit() and (run / "summary.json").is_file():
            found[int(seed)] = run
    return found


def staleness(run: Path) -> dict:
    """Over the run's steps: mean versions behind per trained token (staleness/token_mean, or the
    fixed lag) and versions per completion (1 with a fixed lag)."""
    behind, versions = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "staleness/token_mean" in record:
            behind.append(record["staleness/token_mean"])
            versions.append(record["staleness/versions_per_completion_mean"])
        elif "mismatch/policy_lag" in record:
            behind.append(record["mismatch/policy_lag"])
            versions.append(1.0)
    mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731
    return {"behind": mean(behind), "versions": mean(versions)}


def paired(a: dict[int, dict], b: dict[int, dict], key: str) -> str:
    """'mean ± ci (n)' of a - b over the seeds both have; '*' where the interval excludes 0."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return ""
    diff, ci = mean_ci([a[s][key] - b[s][key] for s in seeds])
    star = "*" if abs(diff) > ci else ""
    return f"{diff:+.3f} ± {ci:.3f}{star} ({len(seeds)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the directory holding the sweep directories")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()

    stats: dict[tuple[str, int, str], dict[int, dict]] = {}
    for regime in REGIMES:
        for s in args.staleness:
            for method in METHODS:
                runs = runs_of(args.root, regime, s, method)
                stats[regime, s, method] = {
                    seed: {**run_stats(run, None), **staleness(run)} for seed, run in runs.items()
                }

    def cell(values: dict[int, dict], key: str, spec=".3f") -> str:
        mean, ci = mean_ci([v[key] for v in values.values()])
        return fmt(mean, spec) + (f" ± {fmt(ci, spec)}" if np.isfinite(ci) else "")

    body = []
    for regime in REGIMES:
        for s in args.staleness:
            for method in METHODS:
                values = stats[regime, s, method]
                if not values:
                    continue
                body.append(
                    [
                        regime,
                        str(s),
                        method,
                        str(len(values)),
                        cell(values, "avg_at_k"),
                        cell(values, "auc"),
                        paired(values, stats[regime, s, "grpo-old"], "auc") if method != "grpo-old" else "",
                        cell(values, "mismatch_kl"),
                        cell(values, "masked_frac", ".2f"),
                        cell(values, "behind", ".2f"),
                        cell(values, "versions", ".3f"),
                    ]
                )
    print("## Per cell (mean ± 95% CI over seeds)\n")
    header = [
        "regime",
        "S",
        "method",
        "seeds",
        "final avg@k",
        "AUC",
        "AUC − grpo-old",
        "KL(μ‖π_old)",
        "masked",
        "behind",
        "versions / completion",
    ]
    print(markdown_table(header, body))

    low, high = min(args.staleness), max(args.staleness)
    body = []
    for method in METHODS:
        row = [method]
        for s in args.staleness:
            row.append(paired(stats["async", s, method], stats["fixed lag", s, method], "auc"))
        for s in args.staleness:
            row.append(paired(stats["async groups", s, method], stats["async", s, method], "auc"))
        for regime in REGIMES:
            row.append(paired(stats[regime, high, method], stats[regime, low, method], "auc"))
        body.append(row)
    print("## Paired by seed: AUC differences (* : the 95% interval excludes 0; pairs in brackets)\n")
    header = (
        ["method"]
        + [f"async − fixed lag, S={s}" for s in args.staleness]
        + [f"groups − waves, S={s}" for s in args.staleness]
        + [f"{regime}: S={high} − S={low}" for regime in REGIMES]
    )
    print(markdown_table(header, body))


if __name__ == "__main__":
    main()
