"""`gppo sweep`: many runs (Divergence x Estimator x seeds, or presets x seeds) and their summary.

Every run is an ordinary run directory OUT/<cell>-s<seed> written by `Trainer`, from the base
training settings plus the cell's point. Grid cells use the directional mask (rule='mask',
anchor='behavior') unless the base settings override rule or anchor; presets keep their own
radii. Runs execute in up to `workers` processes (each with threads=1 unless set). A rerun skips
runs that have summary.json, resumes those with a checkpoint (`Trainer.resume`), and starts the
rest again (the trainer moves the files of a run that stopped before its first checkpoint to
its aborted/ folder).

Radii: `delta` is a reference TV radius at q = 0.5, converted for each (divergence, estimator)
by `gppo.theory.matched_radii` into the radii whose ratio interval at q = 0.5 is
[1 - 2 delta, 1 + 2 delta] (topk, topp and full have no ratio interval and get the binary radii,
which bound them from above: their estimates are >= binary's, so they move no further).

Summary over seeds, per cell (OUT/sweep.csv, OUT/sweep.md, OUT/heatmap.png for a grid):
- greedy, avg_at_k: held-out accuracy at the last evaluation; mean +- ci, where ci is the half
  width of the 95% t-interval t_{0.975, n-1} s / sqrt(n) over the n seeds (s: sample std).
  start_greedy, start_avg_at_k: the same at the first evaluation (step 0 unless resumed from a
  checkpoint of another run), mean over the seeds: where the cell started.
- auc: area under eval/avg@k against the step (trapezoid over evaluated steps, step 0 included)
  divided by the step range: the curve's mean level, in accuracy units.
- steps_to_target: first evaluated step with avg@k >= target, averaged over the seeds that reach
  it (target_reached counts them).
- masked_frac, entropy, mismatch_kl: loss/masked_frac, loss/entropy and mismatch/kl_k3 (the k3
  estimate of KL(mu || pi_old) on the sampled tokens) averaged over the last 10 steps.
- train_seconds: sum of perf/step_seconds (rollout + update; evaluations and start-up excluded).
OUT/curves.png draws, per cell, the mean over seeds of held-out avg@k, rollout reward, the
mismatch metrics, the masked fraction and the entropy against the step.

Paired contrasts (OUT/contrasts.csv, and in sweep.md and on the console against `baseline`, the
first cell unless given): the seeds of every cell share their rollout seeds and held-out set, so
cell A and cell B are compared seed by seed. For each metric (avg_at_k, auc, greedy), d_s = A_s - B_s
over the seeds both finished; reported: the mean of d, the half width t_{0.975, n-1} sd(d) / sqrt(n)
of its 95% interval, and whether that interval excludes 0. Seed-to-seed variation common to both
cells cancels in d, which is what makes the interval narrower than the unpaired ones. A grid also
gets main effects: estimator E against the baseline's estimator with d_s averaged over the
divergences that have both cells, and divergence D against the baseline's divergence averaged over
estimators (contrasts.csv, kind 'estimator' / 'divergence').
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gppo import ESTIMATORS
from gppo.commands.common import DEFAULT_DELTA, DEFAULT_DIVERGENCES, DELTA_HELP, make_divergence
from gppo.commands.sweep_plots import plot_cell_curves
from gppo.commands.sweep_stats import Job, contrast_table, contrasts, display_rows, seed_stats, summarize, write_summary
from gppo.core import closest, drop_unused
from gppo.options import CLI, ArgumentParser, add_arguments, check, given, option
from gppo.report import print_table
from gppo.theory import matched_radii
from gppo.trainer import ConfigError, TrainConfig, Trainer
from gppo.trainer.checkpoint import latest_checkpoint
from gppo.trainer.config import add_config_arguments, config_values, from_dict
from gppo.trainer.logging import MetricsLog

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Keys the sweep sets itself: base settings may not give them (CLI flag to use instead).
SET_BY_SWEEP = {"seed": "--seeds", "output_dir": "--out", "preset": "--presets (or the grid)"}
SET_BY_GRID = {
    "divergence": "--divergences",
    "estimator": "--estimators",
    "delta_low": "--delta",
    "delta_high": "--delta",
}
GRID_POINT = {"preset": "gppo", "rule": "mask", "anchor": "behavior"}  # base settings may override rule, anchor
IGNORED_ON_RERUN = ("threads", "progress")  # may differ between a run and its rerun


def plan(
    base: dict,
    out: str | Path,
    seeds=(0, 1, 2),
    divergences=None,
    estimators=None,
    presets=None,
    delta: float | None = None,
) -> list[Job]:
    """The runs of a grid (divergences x estimators, the default; `delta` defaults to DEFAULT_DELTA)
    or of `presets` (with their own radii), times `seeds`, ordered seed by seed."""
    refused = {**SET_BY_SWEEP, **({} if presets else SET_BY_GRID)}
    for key in base:
        if key in refused:
            raise ConfigError(
                f"the sweep sets {key!r} for every run: remove it from the base settings and use {refused[key]}"
            )
    if presets and (divergences or estimators):
        raise ConfigError("give either presets or a grid (divergences / estimators), not both")
    if presets and delta is not None:
        raise ConfigError(
            "--delta sets the grid's radii; presets keep their own (override them with --delta_low / --delta_high)"
        )
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(
            f"--seeds must be a non-empty list without repeats (got {list(seeds)}); give e.g. --seeds 0 1 2"
        )
    common = {"threads": 1, **base, "progress": False}
    if presets:
        cells = [(name, {**common, "preset": name}) for name in presets]
    else:
        cells = []
        for div in divergences or DEFAULT_DIVERGENCES:
            for est in estimators or list(ESTIMATORS):
                try:
                    low, high = matched_radii(
                        make_divergence(div, base.get("alpha", 0.5)), est, DEFAULT_DELTA if delta is None else delta
                    )
                except ValueError as err:
                    raise ConfigError(f"--delta / --divergences: {err}") from None
                cells.append(
                    (
                        f"{div}-{est}",
                        drop_unused(
                            {
                                **GRID_POINT,
                                **common,
                                "divergence": div,
                                "estimator": est,
                                "delta_low": low,
                                "delta_high": high,
                            }
                        ),
                    )
                )
    out = Path(out)
    # seed by seed: a sweep stopped early holds whole seeds, every cell paired with every other
    return [
        Job(cell, seed, from_dict({**values, "seed": seed, "output_dir": str(out / f"{cell}-s{seed}")}))
        for seed in seeds
        for cell, values in cells
    ]


def _check_rerun(job: Job) -> None:
    """A run directory left by an earlier sweep must hold the same configuration."""
    saved_file = job.config.run_dir() / "config.yaml"
    if not saved_file.is_file():
        return
    planned = job.config.to_dict()
    # a key the saved config lacks (a setting added to gppo since) held its default
    saved = {**TrainConfig().to_dict(), **yaml.safe_load(saved_file.read_text())}
    changed = sorted(
        k for k in set(saved) | set(planned) if k not in IGNORED_ON_RERUN and saved.get(k) != planned.get(k)
    )
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {planned.get(k)!r}" for k in changed[:5])
        raise ConfigError(
            f"{job.config.run_dir()} was run with other settings ({diffs}): use another --out, "
            "or delete that run directory to redo it"
        )


def run_job(config: TrainConfig) -> None:
    """Train one run to the end: resume it from its last checkpoint, or start it (again)."""
    run_dir = config.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "console.log", "a") as log:
        console = Console(file=log, width=120)
        try:
            if latest_checkpoint(run_dir) is not None:
                trainer = Trainer.resume(run_dir, {"threads": config.threads}, console=console)
            else:
                trainer = Trainer(config, console=console)
            trainer.train()
        except Exception:
            console.print_exception()
            raise


def exit_with_parent(parent_pid: int) -> None:
    """Pool-worker initializer: end this worker when the sweep process dies, however it dies.

    A sweep killed with SIGTERM or SIGKILL would otherwise leave its workers training in the
    background, racing the rerun that resumes the same run directories. On Linux the kernel sends
    SIGTERM on the parent's death (prctl PR_SET_PDEATHSIG); elsewhere a killed sweep's workers
    finish their current run."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _execute(jobs: list[Job], workers: int):
    """Yield (job, error or None) as runs finish: in this process for workers=1, else in a pool."""
    if workers == 1:
        for job in jobs:
            try:
                run_job(job.config)
                yield job, None
            except Exception as err:  # one failed run must not stop the sweep
                yield job, err
        return
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = {pool.submit(run_job, job.config): job for job in jobs}
        try:
            for future in as_completed(futures):
                yield futures[future], future.exception()
        except KeyboardInterrupt:  # SIGTERM reaches this process alone: stop the workers' runs too
            for worker in multiprocessing.active_children():
                worker.terminate()
            raise


# ------------------------------------------------------------------------------ entry point
def run_sweep(
    base: dict,
    out: str | Path,
    seeds=(0, 1, 2),
    divergences=None,
    estimators=None,
    presets=None,
    delta: float | None = None,
    workers: int | None = None,
    target: float | None = None,
    baseline: str | None = None,
    progress: bool = True,
    console: Console | None = None,
    summarize_only: bool = False,
) -> dict:
    """Run (or finish) every run of the sweep, then write sweep.csv, contrasts.csv, sweep.md,
    curves.png and, for a grid, heatmap.png into `out`. `baseline` (a cell name; default the
    first cell) is what the printed paired contrasts subtract; `summarize_only` trains nothing and
    summarizes the runs finished so far (a sweep still running elsewhere, or stopped). Returns
    {"rows", "contrasts", "trained", "skipped", "failed"}.

    workers > 1 starts worker processes with 'spawn' (fork is unsafe after torch has started its
    thread pools), which re-imports the calling script: guard it with `if __name__ == "__main__":`.
    """
    console = console or Console()
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise ConfigError(f"workers must be >= 1 (got {workers})")
    jobs = plan(base, out, seeds, divergences, estimators, presets, delta)
    cells = list(dict.fromkeys(job.cell for job in jobs))
    baseline = cells[0] if baseline is None else baseline
    if baseline not in cells:
        raise ConfigError(
            f"--baseline {baseline!r} is not a cell of this sweep{closest(baseline, cells)}; cells: {', '.join(cells)}"
        )
    for job in jobs:
        _check_rerun(job)
    unfinished = [j for j in jobs if not (j.config.run_dir() / "summary.json").is_file()]
    todo = [] if summarize_only else unfinished
    failed, pool_died = [], False
    columns = [
        TextColumn("[bold]sweep[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    piped = progress and not console.is_terminal  # one plain line per finished run, never cut to a width
    doing = "summarizing those, training none" if summarize_only else f"{min(workers, len(todo))} at a time"
    console.print(
        f"sweep: {len(jobs)} runs ({len(jobs) - len(unfinished)} already done), {doing}; each run's files "
        f"and console.log in {Path(out)}/<cell>-s<seed>/",
        soft_wrap=True,
    )
    with Progress(*columns, console=console, disable=not progress or piped) as bar:
        task = bar.add_task(
            "runs",
            total=len(jobs),
            completed=len(jobs) - len(todo),
            info=f"{len(todo)} to run, {min(workers, len(todo))} at a time",
        )
        for job, error in _execute(todo, min(workers, max(len(todo), 1))):
            if isinstance(error, BrokenProcessPool):  # a worker was killed: every run not finished fails with it
                if not pool_died:
                    pool_died = True
                    bar.console.print(
                        f"[red]a worker process died[/] (killed from outside, most often by the kernel "
                        f"for lack of memory: `dmesg` says; each run takes several GB with a real "
                        f"model): the runs not finished stop here. Rerun the same command to resume "
                        f"them, with fewer --workers (now {workers}) if memory is short",
                        soft_wrap=True,
                    )
            elif error is not None:
                bar.console.print(f"[red]failed[/] {job.config.run_dir()}: {error} (see console.log there)")
            if error is not None:
                failed.append(str(job.config.run_dir()))
            bar.update(task, advance=1, info=f"last: {job.cell} seed {job.seed}")
            if piped:
                done = bar.tasks[0]
                console.print(
                    f"sweep: {int(done.completed)}/{len(jobs)} runs, last {job.cell} seed {job.seed}, "
                    f"{done.elapsed or 0:.0f} s elapsed",
                    soft_wrap=True,
                    highlight=False,
                )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    per_seed = seed_stats(jobs, target)
    rows = summarize(jobs, target, per_seed)
    points = None if presets else {r["cell"]: (r["divergence"], r["estimator"]) for r in rows}
    paired = contrasts(per_seed, points, baseline)
    delta = DEFAULT_DELTA if delta is None else delta
    note = f"{len(seeds)} seeds per cell; base settings {base or 'defaults'}; " + (
        "presets keep their radii"
        if presets
        else f"radii matched to TV delta={delta:g} at q=0.5 (interval [1-2δ, 1+2δ])"
    )
    title = None if presets else f"final held-out avg@k, mean ± 95% CI over seeds (δ: TV {delta:g} at q=0.5, matched)"
    write_summary(rows, paired, baseline, out, target, note, title)
    plot_cell_curves(
        {
            cell: [
                MetricsLog(j.config.run_dir() / "metrics.jsonl", [], {}).read()
                for j in jobs
                if j.cell == cell and j.seed in per_seed[cell]
            ]
            for cell in cells
        },
        out / "curves.png",
        f"{out.name}: mean over seeds per cell",
    )
    print_table(console, f"gppo sweep ({out})", *display_rows(rows, target))
    if paired:
        print_table(
            console,
            f"paired contrasts against {baseline} (mean ± 95% CI over seeds; * excludes 0)",
            *contrast_table(paired, baseline),
        )
    console.print(
        f"results in {out}/: sweep.md, sweep.csv, "
        + ("contrasts.csv, " if paired else "")
        + "curves.png"
        + (", heatmap.png" if (out / "heatmap.png").exists() else "")
        + "; the runs in <cell>-s<seed>/",
        soft_wrap=True,
    )
    return {
        "rows": rows,
        "contrasts": paired,
        "trained": len(todo) - len(failed),
        "skipped": len(jobs) - len(todo),
        "failed": failed,
    }


# ------------------------------------------------------------------------------ command
@dataclass
class SweepOptions:
    """Options of `gppo sweep` (training flags apply to every run)."""

    divergences: list[str] | None = option(
        None, "grid rows (default: every divergence but alpha)", "sweep", example=["tv", "kl"]
    )
    estimators: list[str] | None = option(
        None, "grid columns (default: every estimator)", "sweep", example=["binary", "topk"]
    )
    presets: list[str] | None = option(
        None, "run these presets (with their own radii) instead of a grid", "sweep", example=["ppo", "gppo"]
    )
    seeds: list[int] = option([0, 1, 2], "seeds of every cell", "sweep", ge=0)
    delta: float | None = option(
        None, DELTA_HELP + " (default: 0.15; presets keep their own radii)", "sweep", gt=0, example=DEFAULT_DELTA
    )
    workers: int | None = option(
        None, "runs at once (default: the number of cores; each run uses --threads, default 1)", "sweep", ge=1
    )
    target: float | None = option(
        None, "report the first step whose sampled avg@k reaches this accuracy", "sweep", example=0.5
    )
    baseline: str | None = option(
        None,
        "cell the printed paired contrasts subtract, seed by seed (default: the "
        "first cell; every pair is in contrasts.csv)",
        "sweep",
        example="tv-binary",
    )
    out: str = option("runs/sweep", "sweep directory; rerun the same command to resume", "sweep")
    summarize_only: bool = option(False, "train nothing: summarize the runs finished so far", "sweep")


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gppo sweep",
        description="Run a grid of GPPO runs (divergences x estimators x seeds with the directional mask, or "
        "presets x seeds) in parallel, resumably, and summarize it over seeds (sweep.csv, sweep.md with "
        "paired contrasts by seed, contrasts.csv, curves.png, heatmap.png). Training flags below apply "
        "to every run, e.g. --steps 60 --task countdown.",
    )
    add_arguments(p.add_argument_group("sweep"), SweepOptions)
    add_config_arguments(p)
    return p


CONTINUE_HINT = (
    "; run the same command again to continue: finished runs are kept and stopped ones resume from "
    "their last checkpoints"
)


def run(args) -> int:
    o = SweepOptions(**check(SweepOptions, given(args, SweepOptions), CLI))
    result = run_sweep(
        config_values(args),
        o.out,
        o.seeds,
        o.divergences,
        o.estimators,
        o.presets,
        o.delta,
        o.workers,
        o.target,
        o.baseline,
        summarize_only=o.summarize_only,
    )
    return 1 if result["failed"] else 0
