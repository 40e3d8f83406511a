"""How a LoRA policy reaches vLLM, measured in one run: the adapter served per request
(`LoRARequest`, vLLM built with enable_lora) against the base with the adapter merged in and
pushed through the weight reload, with full fine-tuning's reload as the baseline.

SmolLM2-135M-Instruct (float32, vLLM's CPU build or a GPU one), an adapter on every linear layer
(rank `--ranks`, B random so that it changes the policy), the README quickstart's sampling: 8 word
problems x 8 completions of at most 64 tokens at T = 0.7. Per mode, alternating over `--repeats`:

    sync s       update_weights(model): save the adapter (served), or merge and reload every
                 weight (merged, full)
    tokens/s     sampled tokens per second of the batch after the sync

The crossover: served adapters sync faster but decode slower; merging pays off once a sync is
followed by more than (sync_merged - sync_served) / (1/rate_served - 1/rate_merged) sampled tokens.

    python benchmarks/lora_vllm_sync.py --ranks 16 64 --repeats 3      # in the venv with vLLM
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv_cache_gb", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from gppo.models.adapters import LoraOptions, add_adapter
    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout import SamplingParams, make_engine
    from gppo.rollout.vllm_setup import vllm_model_dir
    from gppo.tasks import get_task

    base = vllm_model_dir("smollm2")
    task, rng = get_task("word-problems"), random.Random(0)
    plain, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task.sample(rng).prompt}],
                                             tokenize=False, add_generation_prompt=True) for _ in range(8)]  # fmt: skip
    params = SamplingParams(temperature=0.7, max_new_tokens=64, n=8, seed=0)
    rows = []
    for rank in args.ranks:
        model, _ = load_model_and_tokenizer(base, dtype=torch.float32)
        model = add_adapter(model, LoraOptions(rank, 2.0 * rank, 0.0, ("all-linear",)), seed=0).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.01 * torch.randn(p.shape, generator=gen))
        modes = {"served adapter": (model, rank), "merged": (model, 0)}
        if rank == args.ranks[0]:
            modes["full weights (no LoRA)"] = (plain, 0)
        for mode, (policy, served_rank) in modes.items():
            engine = make_engine("vllm", policy, tokenizer, model_path=base, kv_cache_gb=args.kv_cache_gb,
                                 lora_rank=served_rank)  # fmt: skip
            engine.update_weights(policy)
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up: vLLM loads the adapter
            syncs, rates = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                engine.update_weights(policy)
                syncs.append(time.perf_counter() - start)
                start = time.perf_counter()
                out = engine.generate(prompts, params)
                rates.append(sum(len(g.completion_ids) for g in out) / (time.perf_counter() - start))
            engine.close()
            rows.append((mode, rank if policy is model else "-", statistics.median(syncs), statistics.median(rates)))
            print(rows[-1], flush=True)
    print(f"\nSmolLM2-135M float32, {args.threads} threads, medians of {args.repeats}")
    print("| mode | rank | sync s | tokens/s |\n|---|---|---|---|")
    for mode, rank, sync, rate in rows:
        print(f"| {mode} | {rank} | {sync:.3f} | {rate:.0f} |")
    for rank in args.ranks:
        served = next(r for r in rows if r[0] == "served adapter" and r[1] == rank)
        merged = next(r for r in rows if r[0] == "merged" and r[1] == rank)
        per_token = 1 / served[3] - 1 / merged[3]
        if per_token > 0:
            crossover = f"{(merged[2] - served[2]) / per_token:,.0f} sampled tokens per update"
        else:
            crossover = "none (served decoding was not slower)"
        print(f"rank {rank}: served decodes {merged[3] / served[3]:.2f}x slower per token and syncs "
              f"{merged[2] / max(served[2], 1e-9):.1f}x faster; merging pays off beyond {crossover}")  # fmt: skip


if __name__ == "__main__":
    main()
