"""Wall time of `--rollout_overlap`: one off-policy run (`--off_policy_steps` >= 1) with the next
batch sampled in a background thread while the update trains, against the same run sampling it
between updates (the two produce the same batches; only the wall time may differ).

Each case is a fresh `gppo train` run in a subprocess on the embedded model, sequential and overlap
alternating `--repeats` times. A case's time is the sum of its perf/step_seconds (rollout + update;
evaluations and start-up excluded); the ratio overlap / sequential is taken within each pair and
reported as the median and the range over pairs, so that load drifting during the benchmark moves
both members of a pair alike.

    python benchmarks/overlap_speed.py                      # countdown, 2 threads, 12 steps, 5 pairs
    python benchmarks/overlap_speed.py --threads 1 --steps 20 --repeats 3
    python benchmarks/overlap_speed.py --engine vllm --threads 1 --repeats 3   # in vLLM's venv (docs/vllm.md)

Flags it does not know go to `gppo train` as they are (e.g. `--model smollm2 --task word-problems`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_case(overlap: bool, args, out: Path) -> float:
    """Seconds of training (rollout + update) of one run."""
    command = [
        sys.executable,
        "-m",
        "gppo.cli",
        "train",
        "--task",
        args.task,
        "--steps",
        str(args.steps),
        "--engine",
        args.engine,
        *args.train_flags,
        "--off_policy_steps",
        str(args.off_policy_steps),
        "--rollout_overlap",
        str(overlap).lower(),
        "--threads",
        str(args.threads),
        "--eval_every",
        "0",
        "--eval_size",
        "16",
        "--save_every",
        "0",
        "--progress",
        "false",
        "--output_dir",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sum(r.get("perf/step_seconds", 0.0) for r in records)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="countdown")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--off_policy_steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", default="hf", help="rollout engine: hf or vllm")
    args, args.train_flags = parser.parse_known_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            sequential = run_case(False, args, Path(tmp) / f"sequential-{i}")
            overlap = run_case(True, args, Path(tmp) / f"overlap-{i}")
            pairs.append((sequential, overlap))
            print(
                f"pair {i}: sequential {sequential:.1f} s, overlap {overlap:.1f} s, ratio {overlap / sequential:.3f}",
                flush=True,
            )
    ratios = [o / s for s, o in pairs]
    print(
        f"\n{args.task}, engine {args.engine} {' '.join(args.train_flags)}, {args.steps} steps, off_policy_steps "
        f"{args.off_policy_steps}, {args.threads} threads: "
        f"overlap / sequential median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
        f"{len(ratios)} pairs); sequential median {statistics.median(s for s, _ in pairs):.1f} s"
    )


if __name__ == "__main__":
    main()
