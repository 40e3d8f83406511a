"""Run logging: metrics.jsonl (one fsynced line per step), optional TensorBoard / W&B, PNG curves.

JSON has no NaN or infinity: metrics.jsonl records a non-finite value as the string "nan", "inf" or
"-inf" (what `float()` reads back), and `MetricsLog.read` returns it as a float again.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path

from gppo.report import pyplot, save_figure
from gppo.stats import difference_standard_error
from gppo.trainer.checkpoint import atomic_write_text, no_space_is_an_error


class MetricsLog:
    """Append-only `metrics.jsonl`; every line is flushed and fsynced before the step moves on."""

    def __init__(self, path: Path, report_to: list[str], config: dict):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = [
            sink
            for sink in (_tensorboard(path.parent, report_to), _wandb(path.parent, report_to, config))
            if sink is not None
        ]

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps > step (a resumed run redoes them)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and _parse(line) is not None and _parse(line)["step"] <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        line = json.dumps({k: _encode(v) for k, v in record.items()}, allow_nan=False)
        with no_space_is_an_error(self.path), open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        for sink in self.sinks:
            sink(step, record)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [r for r in map(_parse, self.path.read_text().splitlines()) if r is not None]


_NON_FINITE = ("nan", "inf", "-inf")


def _encode(value):
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _parse(line: str):
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # a line cut by a crash
        return None
    return {k: float(v) if v in _NON_FINITE else v for k, v in record.items()}


def _tensorboard(run_dir: Path, report_to: list[str]):
    if "tensorboard" not in report_to:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "report_to includes tensorboard but it is not installed (pip install gppo[tensorboard])", stacklevel=2
        )
        return None
    writer = SummaryWriter(str(run_dir / "tensorboard"))

    def sink(step, record):
        for key, value in record.items():
            if key not in ("step", "time"):
                writer.add_scalar(key, value, step)
        writer.flush()

    return sink


def _wandb(run_dir: Path, report_to: list[str], config: dict):
    if "wandb" not in report_to:
        return None
    try:
        import wandb
    except ImportError:
        warnings.warn("report_to includes wandb but it is not installed (pip install gppo[wandb])", stacklevel=2)
        return None
    run = wandb.init(dir=str(run_dir), config=config, name=run_dir.name)
    return lambda step, record: run.log({k: v for k, v in record.items() if k != "step"}, step=step)


PLOTS = [
    ("reward", ["rollout/reward_mean", "rollout/accuracy"]),
    ("held-out accuracy", ["eval/greedy", "eval/avg@k"]),
    ("trust region", ["loss/masked_frac"]),
    ("entropy", ["loss/entropy"]),
    ("divergence", ["loss/divergence/mean", "loss/kl_ref"]),
    ("response length", ["rollout/length_mean", "rollout/tool_tokens_mean"]),  # the model's tokens, a tool's
    ("mismatch: KL(mu || pi_old)", ["mismatch/kl_k3", "mismatch/kl_sample"]),
    ("mismatch: |pi_old(a) - mu(a)|", ["mismatch/prob_diff/mean", "mismatch/prob_diff/max"]),
    ("mismatch: pi_old(a) / mu(a)", ["mismatch/ratio/q0.01", "mismatch/ratio/q0.5", "mismatch/ratio/q0.99"]),
    ("staleness: versions behind", ["staleness/token_mean", "staleness/token_max", "staleness/sample_mean"]),
    ("asynchronous: idle fraction", ["staleness/engine_idle_frac", "staleness/trainer_idle_frac"]),
]


def curve_marker(points: int, steps: int) -> str | None:
    """A dot on every point of a short or sparse curve (fewer than 12 points, or logged at fewer than
    half the steps of the run, as held-out evaluations are), so that a line is not read as
    measured between them; dense curves are plain lines."""
    return "o" if points < 12 or 2 * points < steps else None


def plot_curves(records: list[dict], path: Path, title: str) -> Path | None:
    """One PNG with the main curves of a run (reward, accuracy, masked fraction, entropy, ...)."""
    plt = pyplot()
    panels = [(name, keys) for name, keys in PLOTS if any(k in r for r in records for k in keys)]
    if not panels:
        return None
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    steps = len({r["step"] for r in records})
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), marker=curve_marker(len(points), steps), label=key.split("/")[-1])
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_figure(fig, path)


def _with_se(metrics: dict, key: str) -> str:
    se = metrics.get(f"{key}_se")
    return f"{metrics[key]:.3f}" + (f" ± {se:.3f}" if se is not None and math.isfinite(se) else "")


def accuracy_summary(before: dict, after: dict, steps: int, samples: int) -> str:
    """The held-out accuracy before and after RL, each with its standard error (over problems) and
    its number of problems; the greedy change with ± 2 SE of a difference of independent means (a
    conservative bound: the same problems are scored twice). A resumed run evaluated on another
    number of problems gets no change: the two numbers are of different held-out sets."""

    def side(m: dict) -> str:
        size = f" ({int(m['eval/problems'])} problems)" if "eval/problems" in m else ""
        return f"greedy {_with_se(m, 'eval/greedy')}, sampled avg@{samples} {_with_se(m, 'eval/avg@k')}{size}"

    text = f"held-out accuracy before RL: {side(before)}  ->  after {steps} steps: {side(after)}"
    if before.get("eval/problems") != after.get("eval/problems"):
        return text + "; not comparable: the two evaluations used different held-out sets (--eval_size changed)"
    if "eval/greedy_se" in before and "eval/greedy_se" in after:
        change = after["eval/greedy"] - before["eval/greedy"]
        bound = 2 * difference_standard_error(before["eval/greedy_se"], after["eval/greedy_se"])
        text += f"; greedy change {change:+.3f} ± {bound:.3f} (2 SE)"
    return text


def directory_size(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def storage_note(run_dir: Path, trained: str = "the weights") -> str:
    """The size of a run directory and what takes it: checkpoints hold the AdamW moments (twice
    what trains: `trained`, the weights or a LoRA adapter) besides it, so that a run can resume;
    final/ holds it alone."""
    total = directory_size(run_dir)
    checkpoints = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    if not checkpoints:
        return f"{total / 1e9:.2f} GB"
    held = directory_size(run_dir / "checkpoints")
    return (
        f"{total / 1e9:.2f} GB, of which {held / 1e9:.2f} GB in {len(checkpoints)} checkpoint(s) under checkpoints/: "
        f"each holds {trained} and the optimizer state (AdamW's two moments, twice {trained}) to resume from; "
        f"final/ holds {trained} alone, so checkpoints/ can be deleted once the run is done "
        "(--keep_checkpoints 0 deletes them then)"
    )


def progress_info(m: dict) -> str:
    """The progress line's summary of a step's metrics."""
    parts = [
        f"reward {m.get('rollout/reward_mean', float('nan')):.3f}",
        f"acc {m.get('rollout/accuracy', float('nan')):.3f}",
    ]
    if "loss/masked_frac" in m:
        parts.append(f"masked {m['loss/masked_frac']:.3f}")
    if "loss/kl_ref" in m:
        parts.append(f"kl {m['loss/kl_ref']:.4f}")
    if "loss/entropy" in m:
        parts.append(f"ent {m['loss/entropy']:.3f}")
    if "staleness/token_mean" in m:
        parts.append(f"stale {m['staleness/token_mean']:.2f}")
    if "perf/rollout_tokens_per_s" in m:
        parts.append(f"{m['perf/rollout_tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def print_final_report(console, run_dir: Path, summary: dict, samples: int, merged: bool) -> None:
    """The end of a run on the console: held-out accuracy before and after, the adapter saved (with
    LoRA), and what the run directory holds."""
    if summary["before"]:
        console.print(accuracy_summary(summary["before"], summary["after"], summary["steps"], samples), soft_wrap=True)
    adapter = summary["adapter"]
    if adapter:
        console.print(
            f"final/ holds a LoRA adapter of {adapter['parameters']:,} parameters "
            f"({directory_size(run_dir / 'final') / 1e6:.1f} MB with the tokenizer) for the base "
            f"{adapter['base_model']}, which loading it needs (gppo eval --model {run_dir / 'final'}, or "
            f"peft's PeftModel.from_pretrained)"
            + ("; merged/ holds base and adapter merged, a plain model" if merged else ""),
            soft_wrap=True,
        )
    console.print(
        f"run directory: {run_dir} (metrics.jsonl, curves.png, final/): "
        f"{storage_note(run_dir, 'the adapter' if adapter else 'the weights')}",
        soft_wrap=True,
    )
