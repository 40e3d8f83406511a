"""`gppo sweep`, `gppo probe`, `gppo geometry`: statistics against hand-computed values, and each
command end to end on a micro model (resume and skip of sweep runs, probe consistency, closed-form
ratio intervals)."""

import copy
import csv
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gppo import theory
from gppo.cli import main
from gppo.commands.probe import average_ranks, faithfulness, spearman
from gppo.commands.sweep import plan, run_sweep
from gppo.commands.sweep_plots import cell_curve
from gppo.commands.sweep_stats import contrast_table, contrasts, run_stats
from gppo.stats import mean_ci, t_quantile_975
from gppo.theory import matched_radii
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.config import from_dict

MICRO_RUN = [
    "--steps",
    "2",
    "--prompts_per_step",
    "4",
    "--group_size",
    "4",
    "--max_new_tokens",
    "6",
    "--eval_size",
    "8",
    "--eval_samples",
    "2",
    "--eval_every",
    "1",
    "--mini_batch_size",
    "16",
    "--micro_batch_size",
    "16",
    "--save_every",
    "1",
    "--lr",
    "1e-3",
]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------ statistics
def test_t_quantiles_integrate_to_975_percent():
    """Each tabulated / expanded quantile has Student-t CDF 0.975 (trapezoid over the density)."""
    for df in (1, 2, 5, 30, 31, 60):
        t = t_quantile_975(df)
        x = np.linspace(0.0, t, 200_001)
        log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        density = np.exp(log_norm - (df + 1) / 2 * np.log1p(x * x / df))
        assert 0.5 + np.trapezoid(density, x) == pytest.approx(0.975, abs=2e-5), df


def test_mean_ci_by_hand():
    mean, ci = mean_ci([1.0, 2.0, 3.0])  # s = 1, n = 3
    assert mean == 2.0 and ci == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([0.5, None, math.nan]) == (0.5, pytest.approx(math.nan, nan_ok=True))
    assert all(math.isnan(v) for v in mean_ci([]))


def test_run_stats_by_hand(tmp_path):
    records = [{"step": 0, "eval/greedy": 0.1, "eval/avg@k": 0.2}]
    for step in range(1, 13):
        records.append(
            {"step": step, "loss/masked_frac": 0.01 * step, "loss/entropy": 1.0 + step, "perf/step_seconds": 2.0}
        )
    records[6].update({"eval/greedy": 0.5, "eval/avg@k": 0.6})  # step 6
    records[12].update({"eval/greedy": 0.7, "eval/avg@k": 0.5})  # step 12
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = run_stats(tmp_path, target=0.55)
    # trapezoid: 6 * (0.2 + 0.6) / 2 + 6 * (0.6 + 0.5) / 2 = 5.7 over 12 steps
    assert stats["auc"] == pytest.approx(5.7 / 12)
    assert (stats["greedy"], stats["avg_at_k"], stats["steps_to_target"]) == (0.7, 0.5, 6)
    assert (stats["start_greedy"], stats["start_avg_at_k"]) == (0.1, 0.2)
    assert stats["masked_frac"] == pytest.approx(0.01 * np.mean(range(3, 13)))  # last 10 steps
    assert stats["entropy"] == pytest.approx(1.0 + np.mean(range(3, 13)))
    assert stats["train_seconds"] == pytest.approx(24.0)
    assert run_stats(tmp_path, target=0.9)["steps_to_target"] is None


def test_spearman_with_ties_by_hand():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    # ranks x = (1, 2.5, 2.5, 4), y = (1, 3, 2, 4): Pearson = 4.5 / sqrt(4.5 * 5)
    rho = spearman(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0, 4.0]))
    assert rho == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([9.0, 4.0, 1.0])) == pytest.approx(-1.0)
    assert math.isnan(spearman(torch.ones(3), torch.tensor([1.0, 2.0, 3.0])))


def test_faithfulness_counts_violations_and_disagreements():
    """Synthetic tokens: one 'binary' value above the exact one is a violation; thresholds are
    the matched radius on the side of the move."""
    delta_tv = 0.15
    exact = torch.tensor([0.01, 0.2, 0.3, 0.05], dtype=torch.float64)
    tokens = {"q": torch.tensor([0.0005, 0.05, 0.3, 0.9]), "up": torch.tensor([True, False, True, True])}
    for est in ("sample", "cell", "binary", "topk", "topp", "full"):
        tokens[("tv", est)] = exact.clone()
    tokens[("tv", "binary")] = torch.tensor([0.2, 0.2, 0.1, 0.05], dtype=torch.float64)  # token 0 over, token 2 under
    rows = {r["estimator"]: r for r in faithfulness(tokens, delta_tv)}
    binary = rows["binary"]
    assert binary["violations"] == 1 and rows["sample"]["violations"] is None
    assert binary["disagree"] == 0.5  # tokens 0 and 2 cross delta = 0.15 on one side only
    assert binary["disagree q[0,0.001)"] == 1.0 and binary["disagree q[0.5,1]"] == 0.0
    assert math.isnan(binary["disagree q[0.001,0.01)"])
    assert binary["bias"] == pytest.approx((0.19 - 0.2) / 4)
    assert rows["full"]["spearman"] == pytest.approx(1.0) and rows["full"]["disagree"] == 0.0


# ------------------------------------------------------------------------------ matched radii
def test_matched_radii_give_one_interval_at_q_half():
    delta = 0.15
    for name in ("tv", "kl", "chi2", "js"):
        for est in ("sample", "cell", "binary"):
            low, high = matched_radii(name, est, delta)
            lo, hi = theory.ratio_interval(name, est, [0.5], low, high)
            assert (lo[0], hi[0]) == (pytest.approx(1 - 2 * delta, rel=1e-6), pytest.approx(1 + 2 * delta, rel=1e-6))
        assert matched_radii(name, "topk", delta) == matched_radii(name, "binary", delta)
    assert matched_radii("chi2", "cell", delta)[1] == pytest.approx(0.5 * (2 * delta) ** 2)  # RIPO's 0.045
    with pytest.raises(ValueError, match=r"delta must be in \(0, 0.5\)"):
        matched_radii("kl", "binary", 0.5)


# ------------------------------------------------------------------------------ sweep
KILLED_SWEEP = """
import multiprocessing, os, signal, sys
from concurrent.futures import ProcessPoolExecutor
from gppo.commands.sweep import exit_with_parent

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=exit_with_parent,
                               initargs=(os.getpid(),))
    print(pool.submit(os.getpid).result(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9` of a sweep would
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_workers_of_a_killed_sweep_exit(tmp_path):
    script = tmp_path / "killed_sweep.py"
    script.write_text(KILLED_SWEEP)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: a surviving worker would hold pipes open
        done = subprocess.run([sys.executable, str(script)], stdout=stdout, stderr=stderr, timeout=300)
    assert done.returncode == -signal.SIGKILL, err.read_text()
    worker = int(out.read_text().split()[0])

    def running() -> bool:  # a zombie (state Z) has exited and waits to be reaped
        try:
            return Path(f"/proc/{worker}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(), "the pool worker outlived its killed sweep"


def test_sweep_end_to_end_resumes_then_skips(micro_model, tmp_path, capsys):
    out = tmp_path / "sweep"
    grid = ["--divergences", "tv", "kl", "--estimators", "binary", "topk", "--seeds", "0", "1", "--delta", "0.15"]
    base = {
        "model": str(micro_model),
        "steps": 2,
        "prompts_per_step": 4,
        "group_size": 4,
        "max_new_tokens": 6,
        "eval_size": 8,
        "eval_samples": 2,
        "eval_every": 1,
        "mini_batch_size": 16,
        "micro_batch_size": 16,
        "save_every": 1,
        "lr": 1e-3,
        "rollout_dtype": "bfloat16",
    }  # bf16 rollouts: a mismatch to report
    jobs = plan(base, out, [0, 1], ["tv", "kl"], ["binary", "topk"], delta=0.15)
    assert [(j.cell, j.seed) for j in jobs][:5] == [
        ("tv-binary", 0),
        ("tv-topk", 0),
        ("kl-binary", 0),
        ("kl-topk", 0),
        ("tv-binary", 1),
    ]  # seed by seed
    # an interrupted run: stopped after step 1 of 2, with its checkpoint
    interrupted = jobs[0].config
    assert Trainer(interrupted).train(stop_after=1) is None
    before = (interrupted.run_dir() / "metrics.jsonl").read_text().splitlines()

    assert (
        main(
            [
                "sweep",
                "--model",
                str(micro_model),
                "--out",
                str(out),
                "--workers",
                "1",
                "--target",
                "0.5",
                *grid,
                *MICRO_RUN,
                "--rollout_dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out  # piped: one line per finished run, and where everything went
    assert [
        line.split()[1] for line in printed.splitlines() if line.startswith("sweep: ") and " runs, last " in line
    ] == [f"{i}/8" for i in range(1, 9)]
    assert f"results in {out}/: sweep.md, sweep.csv, contrasts.csv, curves.png, heatmap.png" in printed
    after = (interrupted.run_dir() / "metrics.jsonl").read_text().splitlines()
    assert after[:2] == before and len(after) == 3  # steps 0 and 1 kept, step 2 trained on resume
    assert "resumed" in (interrupted.run_dir() / "console.log").read_text()

    rows = read_csv(out / "sweep.csv")
    assert [r["cell"] for r in rows] == ["tv-binary", "tv-topk", "kl-binary", "kl-topk"]
    assert all(r["seeds"] == "2" and r["rule"] == "mask" for r in rows)
    kl = rows[2]
    assert float(kl["delta_high"]) == pytest.approx(theory.matched_radii("kl", "binary", 0.15)[1])
    assert float(rows[0]["delta_low"]) == pytest.approx(0.15)
    assert kl["target_reached"] == "0/2"  # the untrained micro model solves nothing
    # the mismatch column: mean over seeds of each run's mean mismatch/kl_k3 over its (last) steps
    per_run = [
        np.mean(
            [
                r["mismatch/kl_k3"]
                for r in map(json.loads, (out / f"kl-binary-s{seed}" / "metrics.jsonl").read_text().splitlines())
                if r["step"] > 0
            ]
        )
        for seed in (0, 1)
    ]
    assert float(kl["mismatch_kl"]) == pytest.approx(np.mean(per_run), rel=1e-9) and np.mean(per_run) > 0
    assert "| tv-binary | mask | 0.15 / 0.15 | 2 |" in (out / "sweep.md").read_text()
    # where the cell started: the mean over seeds of each run's step-0 evaluation, shown as start -> end
    starts = [json.loads((out / f"kl-binary-s{seed}" / "metrics.jsonl").read_text().splitlines()[0]) for seed in (0, 1)]
    assert float(kl["start_avg_at_k"]) == pytest.approx(np.mean([r["eval/avg@k"] for r in starts]))
    assert f"| {float(kl['start_greedy']):.3f} → {float(kl['greedy']):.3f}" in (out / "sweep.md").read_text()
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    paired = read_csv(out / "contrasts.csv")
    assert {r["kind"] for r in paired} == {"cell", "divergence", "estimator"}
    assert len([r for r in paired if r["kind"] == "cell"]) == 6 * 3 and {r["pairs"] for r in paired} == {"2"}
    assert "## Paired contrasts against tv-binary" in (out / "sweep.md").read_text()
    assert "| estimator topk − binary | 2 |" in (out / "sweep.md").read_text()

    summaries = sorted(out.glob("*/summary.json"))
    assert len(summaries) == 8
    # a summary of what has finished, training nothing: one seed of each cell gone -> 1 seed per cell
    (out / "tv-binary-s1" / "summary.json").rename(out / "tv-binary-s1" / "summary.moved")
    partial = run_sweep(
        base, out, [0, 1], ["tv", "kl"], ["binary", "topk"], workers=1, progress=False, summarize_only=True
    )
    assert partial["trained"] == 0 and not (out / "tv-binary-s1" / "summary.json").exists()
    assert [r["seeds"] for r in partial["rows"]] == [1, 2, 2, 2]
    (out / "tv-binary-s1" / "summary.moved").rename(out / "tv-binary-s1" / "summary.json")
    stamps = [p.stat().st_mtime_ns for p in summaries]
    rerun = run_sweep(base, out, [0, 1], ["tv", "kl"], ["binary", "topk"], workers=1, progress=False)
    assert (rerun["trained"], rerun["skipped"], rerun["failed"]) == (0, 8, [])
    assert [p.stat().st_mtime_ns for p in summaries] == stamps

    with pytest.raises(ConfigError, match="was run with other settings.*lr"):
        run_sweep({**base, "lr": 1e-4}, out, [0, 1], ["tv", "kl"], ["binary", "topk"], workers=1, progress=False)


def _stats(values: dict[int, float]) -> dict[int, dict]:
    return {seed: {"avg_at_k": v, "auc": v / 2, "greedy": 2 * v} for seed, v in values.items()}


def test_paired_contrasts_are_per_seed_differences():
    per_seed = {"A": _stats({0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9}), "B": _stats({0: 0.4, 1: 0.48, 2: 0.6})}
    rows = {r["metric"]: r for r in contrasts(per_seed, None, "A")}
    assert set(rows) == {"avg_at_k", "auc", "greedy"}
    r = rows["avg_at_k"]
    # d = (0.1, 0.12, 0.1) over the 3 seeds both finished: mean 0.10667, sd 0.011547, t_{0.975,2} = 4.303
    assert (r["kind"], r["a"], r["b"], r["pairs"]) == ("cell", "A", "B", 3)
    assert r["diff"] == pytest.approx(0.32 / 3)
    assert r["ci"] == pytest.approx(4.303 * math.sqrt(1 / 7500) / math.sqrt(3))
    assert r["significant"]  # 0.107 > 0.029
    assert rows["greedy"]["diff"] == pytest.approx(0.64 / 3) and rows["auc"]["ci"] == pytest.approx(r["ci"] / 2)
    # the unpaired interval of A alone is wider than the paired one: common seed effects cancel
    assert mean_ci([0.5, 0.6, 0.7])[1] > r["ci"]


def test_cell_curve_is_the_mean_over_seeds_then_a_trailing_mean():
    runs = [
        [{"step": 0, "x": 1.0}, {"step": 1, "x": 3.0}, {"step": 2, "x": 5.0}, {"step": 3, "x": 7.0}],
        [{"step": 0, "x": 3.0}, {"step": 1, "x": 5.0}, {"step": 2, "x": 9.0}],
    ]  # seed 2 stopped at step 2
    steps, mean = cell_curve(runs, "x")
    assert steps.tolist() == [0, 1, 2] and mean.tolist() == [2.0, 4.0, 7.0]
    assert cell_curve(runs, "x", smooth=2)[1].tolist() == [2.0, 3.0, 5.5]
    assert cell_curve(runs, "missing")[0].tolist() == []


def test_grid_main_effects_average_over_the_other_axis():
    points = {
        "tv-binary": ("tv", "binary"),
        "tv-topk": ("tv", "topk"),
        "kl-binary": ("kl", "binary"),
        "kl-topk": ("kl", "topk"),
    }
    per_seed = {
        "tv-binary": _stats({0: 0.50, 1: 0.40}),
        "tv-topk": _stats({0: 0.60, 1: 0.45}),
        "kl-binary": _stats({0: 0.30, 1: 0.20}),
        "kl-topk": _stats({0: 0.50, 1: 0.20}),
    }
    rows = contrasts(per_seed, points, "tv-binary")
    assert len([r for r in rows if r["kind"] == "cell"]) == 6 * 3  # every pair, 3 metrics
    est = next(r for r in rows if r["kind"] == "estimator" and r["metric"] == "avg_at_k")
    # seed 0: ((0.6 - 0.5) + (0.5 - 0.3)) / 2 = 0.15; seed 1: ((0.45 - 0.4) + (0.2 - 0.2)) / 2 = 0.025
    assert (est["a"], est["b"], est["pairs"]) == ("topk", "binary", 2)
    assert est["diff"] == pytest.approx(0.0875)
    assert est["ci"] == pytest.approx(12.706 * np.std([0.15, 0.025], ddof=1) / math.sqrt(2))
    div = next(r for r in rows if r["kind"] == "divergence" and r["metric"] == "avg_at_k")
    assert (div["a"], div["b"]) == ("kl", "tv")
    assert div["diff"] == pytest.approx(np.mean([((0.3 - 0.5) + (0.5 - 0.6)) / 2, ((0.2 - 0.4) + (0.2 - 0.45)) / 2]))
    header, body = contrast_table(contrasts(per_seed, points, "tv-topk"), "tv-topk")  # not the first cell: signs flip
    labels = [line[0] for line in body]
    assert labels[:3] == ["tv-binary − tv-topk", "kl-binary − tv-topk", "kl-topk − tv-topk"]
    assert body[0][2].startswith("-0.075 ± ")  # mean of (0.5 - 0.6, 0.4 - 0.45)
    assert "estimator binary − topk" in labels and "divergence kl − tv" in labels


def test_sweep_plans_presets_and_refuses_what_it_sets(tmp_path):
    jobs = plan({"steps": 5}, tmp_path, [3], presets=["ppo", "ripo"])
    assert [(j.cell, j.seed, j.config.preset, j.config.threads) for j in jobs] == [
        ("ppo", 3, "ppo", 1),
        ("ripo", 3, "ripo", 1),
    ]
    assert jobs[1].config.gppo_config().delta_high == 0.05  # presets keep their radii
    assert jobs[0].config.run_dir() == tmp_path / "ppo-s3"
    with pytest.raises(ConfigError, match="'seed'.*--seeds"):
        plan({"seed": 1}, tmp_path)
    with pytest.raises(ConfigError, match="'delta_low'.*--delta"):
        plan({"delta_low": 0.1}, tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        plan({}, tmp_path, presets=["ppo"], divergences=["kl"])
    with pytest.raises(ConfigError, match="presets keep their own"):
        plan({}, tmp_path, presets=["ppo"], delta=0.1)
    with pytest.raises(ConfigError, match="divergence"):
        plan({}, tmp_path, divergences=["kll"])


def test_sweep_refuses_a_baseline_that_is_no_cell(tmp_path):
    with pytest.raises(ConfigError, match="--baseline 'tv-binery' is not a cell of this sweep.*tv-binary"):
        run_sweep({"steps": 1}, tmp_path, [0], ["tv"], ["binary"], baseline="tv-binery", progress=False)


def test_a_killed_worker_is_reported_once_and_the_sweep_ends(micro_model, tmp_path):
    """A worker killed from outside (here by its reward function; in practice the out-of-memory
    killer) breaks the pool: one message says so and how to resume, every unfinished run is listed
    as failed, and the summary is still written."""
    from io import StringIO

    from rich.console import Console

    base = {
        "model": str(micro_model),
        "steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_new_tokens": 3,
        "eval_size": 4,
        "eval_every": 0,
        "reward_funcs": ["tests.reward_fns:kills_its_process"],
    }
    printed = StringIO()
    result = run_sweep(
        base,
        tmp_path / "sweep",
        [0, 1],
        presets=["gppo"],
        workers=2,
        progress=False,
        console=Console(file=printed, width=200),
    )
    assert sorted(result["failed"]) == [str(tmp_path / "sweep" / f"gppo-s{seed}") for seed in (0, 1)]
    text = printed.getvalue()
    assert text.count("a worker process died") == 1 and "Rerun the same command" in text
    assert (tmp_path / "sweep" / "sweep.md").is_file()


def test_sweep_cli_names_the_closest_flag(capsys):
    assert main(["sweep", "--divergnces", "kl"]) == 2
    assert "gppo sweep: error: unknown option --divergnces (did you mean --divergences?)" in capsys.readouterr().err


# ------------------------------------------------------------------------------ probe
def test_probe_is_internally_consistent(micro_model, tmp_path):
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                "--model",
                str(micro_model),
                "--out",
                str(out),
                "--divergences",
                "tv",
                "kl",
                "chi2",
                "--prompts_per_step",
                "8",
                "--group_size",
                "4",
                "--max_new_tokens",
                "6",
                "--mini_batch_size",
                "8",
                "--micro_batch_size",
                "16",
                "--reward_funcs",
                "tests.reward_fns:length_bonus",
                "--threads",
                "1",
                "--mass_k",
                "1",
                "5",
                "20",
                "64",
            ]
        )
        == 0
    )
    rows = read_csv(out / "probe.csv")
    assert len(rows) == 3 * 6
    for r in rows:
        assert float(r["exact_mean"]) > 0  # the update moved the policy
        if r["estimator"] == "full":
            assert float(r["spearman"]) == pytest.approx(1.0)
            assert float(r["disagree"]) == 0.0 and float(r["bias"]) == 0.0
        if r["estimator"] != "sample":
            assert r["violations"] == "0" and float(r["bias"]) <= 0.0  # lower bounds of the exact D_f
    md = (out / "probe.md").read_text()
    mass = [float(x) for x in md.split("| mu-mass of mu's top-K |")[1].split("\n")[0].strip(" |").split(" | ")]
    assert mass == sorted(mass) and mass[-1] == pytest.approx(1.0) and mass[0] < 1  # V = 55 < 64
    assert (out / "probe.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_needs_no_heldout_split_states_its_update_and_chunks_exactly(micro_model, tmp_path, capsys):
    """A 100-row file works (the probe evaluates nothing); the update size is reported and agrees
    with the exact TV row; one-sequence passes give the same values as one pass over all."""
    from gppo.commands.probe import token_values, update_size

    data = tmp_path / "hundred.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(100)))
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                "--model",
                str(micro_model),
                "--data",
                str(data),
                "--out",
                str(out),
                "--divergences",
                "tv",
                "chi2",
                "--prompts_per_step",
                "8",
                "--group_size",
                "4",
                "--max_new_tokens",
                "6",
                "--mini_batch_size",
                "8",
                "--reward_funcs",
                "tests.reward_fns:length_bonus",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert f"results in {out}/" in printed and "Update size: mean exact TV(pi, mu) per token" in printed
    rows = {(r["divergence"], r["estimator"]): r for r in read_csv(out / "probe.csv")}
    tv_mean = float(printed.split("per token ")[1].split(",")[0])
    assert tv_mean == pytest.approx(float(rows[("tv", "full")]["exact_mean"]), rel=1e-2)
    # mu is the float32 model that sampled: its float64 recomputation equals what the engine recorded
    gap_max = float(printed.split("engine hf recorded: |difference| median ")[1].split("max ")[1].split()[0])
    assert gap_max < 1e-4
    assert float(rows[("chi2", "full")]["exact_median"]) <= float(rows[("chi2", "full")]["exact_mean"])

    # the values of token_values do not depend on how many sequences a pass takes
    config = from_dict(
        {
            "model": str(micro_model),
            "prompts_per_step": 4,
            "group_size": 2,
            "max_new_tokens": 5,
            "reward_funcs": ["tests.reward_fns:digit_share"],  # varies within a group: the update moves
            "output_dir": str(tmp_path / "t"),
            "threads": 1,
            "lr": 1e-2,
            "micro_batch_size": 8,
            "mini_batch_size": 8,
        }
    )
    trainer = Trainer(config)
    rollout = trainer.prepare(trainer.rollout()[0])
    mu = copy.deepcopy(trainer.model)
    trainer.update(rollout)
    loss = config.gppo_config()
    one = token_values(mu, trainer.model, rollout, 1.0, ["tv", "chi2"], loss, chunk=1)
    every = token_values(mu, trainer.model, rollout, 1.0, ["tv", "chi2"], loss, chunk=rollout.size)
    for key in every:
        assert torch.allclose(one[key].double(), every[key].double(), rtol=1e-9, atol=1e-12), key
    assert torch.allclose(every["tv_exact"], every[("tv", "full")], rtol=1e-6, atol=1e-9)
    size = update_size(every)
    assert 0 <= size["logratio_median"] <= size["logratio_max"] and size["logratio_max"] > 0
    trainer.close()


# ------------------------------------------------------------------------------ geometry
def test_geometry_csv_matches_closed_forms(tmp_path):
    delta = 0.05
    assert (
        main(
            [
                "geometry",
                "--raw",
                "--delta",
                str(delta),
                "--divergences",
                "tv",
                "chi2",
                "--points",
                "9",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = read_csv(tmp_path / "geometry.csv")
    assert len(rows) == 2 * 3 * 9
    for r in rows:
        q, lo, hi = float(r["q"]), float(r["lo"]), float(r["hi"])
        # half widths, capped at p <= 1: PPO's interval is the same for every q (until the cap)
        width = {("tv", "sample"): 2 * delta, ("chi2", "cell"): math.sqrt(delta / q), ("tv", "binary"): delta / q}.get(
            (r["divergence"], r["estimator"])
        )
        if width is not None:
            assert lo == pytest.approx(max(0.0, 1 - width), rel=1e-6, abs=1e-12)
            assert hi == pytest.approx(min(1 + width, 1 / q), rel=1e-6)
    assert (tmp_path / "geometry.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["geometry", "--delta", "0.7", "--out", str(tmp_path)]) == 2  # matched radii need delta < 0.5
