"""The figures of `gppo sweep`: the Divergence x Estimator heatmap of the final accuracy and the
per-cell training curves (means over seeds)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gppo.report import fmt, pyplot, save_figure, text_color


def plus_minus(row: dict, key: str) -> str:
    """'mean ± ci' of `key` in a summary row (the mean alone where the interval is undefined)."""
    ci = fmt(row[f"{key}_ci"])
    return fmt(row[key]) + (f" ± {ci}" if ci else "")


def plot_heatmap(rows: list[dict], path: Path, title: str) -> Path:
    """Divergence x Estimator image of the final avg@k mean, annotated with mean ± ci."""
    plt = pyplot()
    divs = list(dict.fromkeys(r["divergence"] for r in rows))
    ests = list(dict.fromkeys(r["estimator"] for r in rows))
    grid = np.full((len(divs), len(ests)), np.nan)
    for r in rows:
        grid[divs.index(r["divergence"]), ests.index(r["estimator"])] = r["avg_at_k"]
    fig, ax = plt.subplots(figsize=(1.5 * len(ests) + 2.5, 0.7 * len(divs) + 1.8))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    for r in rows:
        ax.text(
            ests.index(r["estimator"]),
            divs.index(r["divergence"]),
            plus_minus(r, "avg_at_k").replace(" ± ", "\n± "),
            ha="center",
            va="center",
            fontsize=8,
            color=text_color(image, r["avg_at_k"]),
        )
    fig.colorbar(image, ax=ax, label="final avg@k (mean over seeds)")
    ax.set_xticks(range(len(ests)), ests)
    ax.set_yticks(range(len(divs)), divs)
    ax.set_xlabel("estimator")
    ax.set_ylabel("divergence")
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


# (title, metric keys): a cell draws the first key its runs logged (truncate rules log
# loss/truncated_frac where masking rules log loss/masked_frac).
CURVE_PANELS = (
    ("held-out avg@k", ("eval/avg@k",)),
    ("rollout reward", ("rollout/reward_mean",)),
    ("mismatch KL(mu || pi_old), k3", ("mismatch/kl_k3",)),
    ("mismatch |pi_old(a) - mu(a)|, mean", ("mismatch/prob_diff/mean",)),
    ("masked / truncated fraction", ("loss/masked_frac", "loss/truncated_frac")),
    ("entropy", ("loss/entropy",)),
)
SMOOTHING = 5  # steps of the trailing mean of per-step training curves (evaluations are not smoothed)


def cell_curve(runs: list[list[dict]], key: str, smooth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(steps, mean over runs) of metric `key` at the steps every run logged it, then the trailing
    mean over `smooth` steps (fewer at the start)."""
    series = [{r["step"]: r[key] for r in records if key in r} for records in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    mean = np.array([np.mean([s[step] for s in series]) for step in steps], dtype=np.float64)
    if smooth > 1 and len(mean):
        cumulative = np.concatenate([[0.0], np.cumsum(mean)])
        index = np.arange(1, len(mean) + 1)
        mean = (cumulative[index] - cumulative[np.maximum(index - smooth, 0)]) / np.minimum(index, smooth)
    return np.array(steps, dtype=np.float64), mean


def plot_cell_curves(records: dict[str, list[list[dict]]], path: Path, title: str) -> Path | None:
    """One panel per entry of CURVE_PANELS that any run logged, one line per cell: the mean over its
    seeds (per-step metrics smoothed over SMOOTHING steps, evaluations not)."""

    def curve(runs, keys):
        key = next((k for k in keys if any(k in r for records_ in runs for r in records_)), keys[0])
        return cell_curve(runs, key, 1 if key.startswith("eval/") else SMOOTHING)

    curves = {name: {cell: curve(runs, keys) for cell, runs in records.items() if runs} for name, keys in CURVE_PANELS}
    panels = [name for name, per_cell in curves.items() if any(len(steps) for steps, _ in per_cell.values())]
    if not panels:
        return None
    plt = pyplot()
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    styles = ["-", "--", ":", "-."]
    for ax, name in zip(axes.flat, panels):
        for i, (cell, (steps, mean)) in enumerate(curves[name].items()):
            ax.plot(steps, mean, styles[(i // 10) % len(styles)], color=f"C{i % 10}", label=cell, linewidth=1.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2 if len(records) > 8 else 1)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
