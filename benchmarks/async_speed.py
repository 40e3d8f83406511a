"""Steps per hour of `--async_rollouts` against the synchronous run at equal batch and equal total
threads, with both idle fractions, peak RSS, and the gain projected to a GPU's balance.

Each mode is a fresh `gppo train` in a subprocess, modes alternating `--repeats` times so that load
drifting during the benchmark moves all of them alike. Peak RSS is that of the whole process tree
(the run and every process it starts, summed, sampled every 0.2 s): asynchronous vLLM runs in
processes of its own (`--vllm_own_process`), which a single process's peak would leave out.
`async-in-process` keeps vLLM in the trainer's process (`--vllm_own_process false`, engine vllm);
`async-server` samples through vLLM's own OpenAI-compatible server (`--vllm_server true`).
A run's time per step is the mean of perf/step_seconds over its steps after the first (the first
asynchronous step has nothing to overlap with); evaluations and start-up are excluded.

Phase times come from the synchronous run: G = perf/rollout_seconds (generate and score) and U =
perf/update_seconds (pi_old, reference and update), W = perf/weight_sync_seconds of the
asynchronous run. Where generation takes a share g of a synchronous step (0.7 on a GPU, where
decoding is memory-bound and an update compute-bound), perfect overlap takes the step from G + U to
max(G, U) + W: the projected gain is 1 / (max(g, 1 - g) + w), w = W / (G + U) as measured here.

    python benchmarks/async_speed.py                                  # embedded countdown, hf engine
    python benchmarks/async_speed.py --modes sync async partial --steps 6
    python benchmarks/async_speed.py --modes sync async async-waves --max_new_tokens 64  # long tails: refill pays
    # the issue's setting, in vLLM's venv (docs/vllm.md): SmolLM2, word problems (GSM8K-like), 8 x 8 x 256
    OMP_NUM_THREADS=1 python benchmarks/async_speed.py --engine vllm --modes sync async --steps 3 \\
        --model smollm2 --task word-problems --max_new_tokens 256 --prompts_per_step 8 --group_size 8 \\
        --mini_batch_size 32 --micro_batch_size 4   # micro-batches of 4: the update's activations fit in 24 GB

Flags it does not know go to `gppo train` as they are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {  # mode -> the flags that make it
    "sync": [],
    "async": ["--async_rollouts", "true"],  # continuous batching (--async_batching groups)
    "async-waves": ["--async_rollouts", "true", "--async_batching", "waves"],  # a step's batch in one engine call
    "partial": ["--async_rollouts", "true", "--partial_rollouts", "true"],
    "async-in-process": ["--async_rollouts", "true", "--vllm_own_process", "false"],
    "async-server": ["--async_rollouts", "true", "--vllm_server", "true"],  # vLLM's OpenAI server, over HTTP
}
RSS_POLL_S = 0.2
GPU_GENERATION_SHARE = 0.7


def run_mode(mode: str, args, out: Path) -> dict:
    """One run: seconds per step after the first, its phase and idle means, its peak RSS (GB)."""
    staleness = ["--max_staleness", str(args.max_staleness)] if mode != "sync" else []
    command = [
        sys.executable,
        "-m",
        "gppo.cli",
        "train",
        "--engine",
        args.engine,
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        *MODES[mode],
        *staleness,
        *args.train_flags,
        "--eval_every",
        "0",
        "--eval_size",
        "4",
        "--eval_samples",
        "1",
        "--save_every",
        "0",
        "--keep_checkpoints",
        "0",
        "--progress",
        "false",
        "--output_dir",
        str(out),
    ]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak = tree_rss_peak(process)
        if process.returncode:
            log.seek(0)
            sys.exit(f"{mode} run failed ({' '.join(command)}):\n{log.read()[-6000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "perf/step_seconds" in r][1:]

    def mean(key):
        values = [r[key] for r in steps if key in r]
        return statistics.mean(values) if values else float("nan")

    trained = [r["perf/train_tokens_per_s"] * r["perf/update_seconds"] for r in steps if "perf/update_seconds" in r]
    return {
        "step_s": mean("perf/step_seconds"),
        # lengths drift as the policy learns: wall time per 1,000 trained tokens compares runs that drift apart
        "s_per_k": 1000 * sum(r["perf/step_seconds"] for r in steps) / max(sum(trained), 1.0),
        "rollout_s": mean("perf/rollout_seconds"),
        "update_s": mean("perf/update_seconds"),
        "sync_s": mean("perf/weight_sync_seconds"),
        "engine_idle": mean("staleness/engine_idle_frac"),
        "trainer_idle": mean("staleness/trainer_idle_frac"),
        "staleness": mean("staleness/token_mean"),
        "rss_gb": peak / 1e9,
    }


def tree_rss_peak(process: subprocess.Popen) -> int:
    """Wait for `process`; the largest sum of resident bytes of it and all its descendants seen."""
    import psutil

    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        total = 0
        for each in [root, *root.children(recursive=True)]:
            try:
                total += each.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                pass
        peak = max(peak, total)
        time.sleep(RSS_POLL_S)
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=list(MODES))
    parser.add_argument("--engine", default="hf", help="rollout engine: hf or vllm")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max_staleness", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="total: async splits them between engine and trainer")
    parser.add_argument("--repeats", type=int, default=1)
    args, args.train_flags = parser.parse_known_args()
    if "--task" not in args.train_flags:
        args.train_flags += ["--task", "countdown"]
    results = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in args.modes:
                results[mode].append(run_mode(mode, args, Path(tmp) / f"{mode}-{repeat}"))
                r = results[mode][-1]
                print(
                    f"{mode} #{repeat}: {r['step_s']:.1f} s/step, rss {r['rss_gb']:.2f} GB, "
                    f"engine idle {r['engine_idle']:.2f}, trainer idle {r['trainer_idle']:.2f}",
                    flush=True,
                )
    base = (
        {k: statistics.median(r[k] for r in results["sync"]) for k in results["sync"][0]} if "sync" in results else None
    )
    print(f"\nengine {args.engine}, {args.steps} steps, {args.threads} threads, {' '.join(args.train_flags)}")
    print(
        "| mode | s/step | steps/hour | vs sync | s per 1k trained tokens | vs sync | engine idle | trainer idle | "
        "tokens behind | weight sync s | peak RSS GB | RSS vs sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = base["step_s"] / m["step_s"] if base else float("nan")
        per_token = base["s_per_k"] / m["s_per_k"] if base else float("nan")
        rss = m["rss_gb"] / base["rss_gb"] if base else float("nan")
        print(
            f"| {mode} | {m['step_s']:.1f} | {3600 / m['step_s']:.0f} | {ratio:.2f}x | {m['s_per_k']:.2f} | "
            f"{per_token:.2f}x | {m['engine_idle']:.2f} | "
            f"{m['trainer_idle']:.2f} | {m['staleness']:.2f} | {m['sync_s']:.2f} | {m['rss_gb']:.2f} | {rss:.2f} |"
        )
    if base and "async" in results:
        g, u = base["rollout_s"], base["update_s"]
        w = statistics.median(r["sync_s"] for r in results["async"]) / (g + u)
        share = GPU_GENERATION_SHARE
        print(
            f"\nsynchronous phases: generate {g:.1f} s ({g / (g + u):.0%}), update {u:.1f} s; weight sync {w:.1%} of a "
            f"step. Ideal overlap here: {(g + u) / (max(g, u) + w * (g + u)):.2f}x; at a GPU's balance "
            f"(generation {share:.0%} of a step): {1 / (max(share, 1 - share) + w):.2f}x"
        )


if __name__ == "__main__":
    main()
