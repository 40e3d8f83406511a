"""LoRA against full fine-tuning: peak memory and step time of `gppo train`, measured in one run.

Each variant runs one RL step in a fresh subprocess that reports its own peak RSS (ru_maxrss:
weights, gradients, optimizer, sampling and update together) and gppo's perf/step_seconds:

    full        every weight trains: float32 weights, gradients and AdamW moments (16 bytes each)
    lora        a rank-16 adapter on every linear layer of a frozen float32 base (--use_peft)
    lora-bf16   the same with the base in bfloat16 (--use_peft --dtype bfloat16; adapter float32)

Models: `--model smollm2` (SmolLM2-135M-Instruct at the README quickstart's sizes: 8 word problems
x 8 completions of at most 64 tokens), or `--shape qwen2.5-0.5b` / `qwen2.5-1.5b`: a randomly
initialised Qwen2 of that shape, made locally (no download), with the embedded character
tokenizer, 2 addition problems x 4 completions of 32 tokens, rewarded by the share of digits in the
completion (`digit_share`, so that the random model's rewards vary and the update runs).

    python benchmarks/lora_memory.py --model smollm2
    python benchmarks/lora_memory.py --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, tied embeddings)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip
VARIANTS = {"full": [], "lora": ["--use_peft"], "lora-bf16": ["--use_peft", "--dtype", "bfloat16"]}
QUICKSTART = ["--model", "smollm2", "--task", "word-problems", "--prompts_per_step", "8", "--group_size", "8",
              "--max_new_tokens", "64", "--temperature", "0.7", "--lr", "2e-5", "--epochs", "1",
              "--mini_batch_size", "32", "--micro_batch_size", "8", "--eval_size", "8"]  # fmt: skip
RANDOM_MODEL = ["--task", "addition", "--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "32",
                "--epochs", "1", "--mini_batch_size", "8", "--micro_batch_size", "8", "--eval_size", "2",
                "--reward_funcs", f"{__file__}:digit_share"]  # fmt: skip


def digit_share(prompts, completions, **_):
    """The share of digits in each completion: a reward that varies on a random model's text."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def random_model(shape: str, out: Path) -> Path:
    """A randomly initialised Qwen2 of `shape` with the embedded tokenizer, saved to `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gppo.models.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(**SHAPES[shape], vocab_size=151_936, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def child(args: list[str]) -> None:
    from gppo.cli import main

    status = main(args)
    rows = [json.loads(line) for line in (Path(args[args.index("--output_dir") + 1]) / "metrics.jsonl").open()]
    step = next(r["perf/step_seconds"] for r in rows if "perf/step_seconds" in r)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print("RESULT " + json.dumps({"status": status, "step_s": step, "peak_gb": peak}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2"], help="the quickstart's model and sizes")
    parser.add_argument("--shape", choices=list(SHAPES), help="a random model of this shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if bool(args.model) == bool(args.shape):
        parser.error("give --model smollm2 or --shape NAME")
    with tempfile.TemporaryDirectory() as tmp:
        base = (
            QUICKSTART if args.model else ["--model", str(random_model(args.shape, Path(tmp) / "model")), *RANDOM_MODEL]
        )
        results = {}
        for name, flags in VARIANTS.items():
            run = [*base, *flags, "--steps", "1", "--eval_every", "0", "--eval_samples", "1", "--save_every", "0",
                   "--keep_checkpoints", "0", "--threads", str(args.threads), "--progress", "false",
                   "--output_dir", str(Path(tmp) / name)]  # fmt: skip
            done = subprocess.run([sys.executable, __file__, "--child", "train", *run], capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            results[name] = json.loads(lines[-1][7:])
            print(f"{name}: {results[name]}", flush=True)
    print(f"\n{args.model or args.shape}, {args.threads} threads, one RL step each")
    print("| variant | peak RSS GB | x full | step s | x full |\n|---|---|---|---|---|")
    for name, r in results.items():
        full = results["full"]
        print(f"| {name} | {r['peak_gb']:.2f} | {r['peak_gb'] / full['peak_gb']:.2f} | {r['step_s']:.1f} | "
              f"{r['step_s'] / full['step_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
