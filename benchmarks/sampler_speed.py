"""The HF engine's sampler: inverse-CDF draws (`gppo.rollout.hf.inverse_cdf_sample`) against
`torch.multinomial`, measured in one run, alternating, on the README quickstart's sampling phase
(SmolLM2-135M-Instruct float32, 8 word problems x 8 completions of at most 64 tokens, T = 0.7)
and on the draw alone (64 rows of SmolLM2's 49,152-token vocabulary):

    python benchmarks/sampler_speed.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import gppo.rollout.hf as hf


def multinomial(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


SAMPLERS = {"multinomial": multinomial, "inverse_cdf": hf.inverse_cdf_sample}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout.base import SamplingParams
    from gppo.tasks import get_task

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(64, 49152, generator=gen), -1)
    model, tokenizer = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    task, rng = get_task("word-problems"), random.Random(0)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task.sample(rng).prompt}],
                                             tokenize=False, add_generation_prompt=True) for _ in range(8)]  # fmt: skip
    params = SamplingParams(temperature=0.7, max_new_tokens=64, n=8, seed=0)
    draw = {name: [] for name in SAMPLERS}
    phase = {name: [] for name in SAMPLERS}
    for _ in range(args.repeats):
        for name, sampler in SAMPLERS.items():
            start = time.perf_counter()
            for _ in range(20):
                sampler(probs, gen)
            draw[name].append((time.perf_counter() - start) / 20)
            hf.inverse_cdf_sample = sampler  # what HFEngine._sample calls
            engine = hf.HFEngine(model.eval(), tokenizer, batch_size=64)
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            phase[name].append((time.perf_counter() - start, sum(len(g.completion_ids) for g in out)))
    hf.inverse_cdf_sample = SAMPLERS["inverse_cdf"]
    print(f"{args.threads} threads, {args.repeats} alternating repeats (medians)\n")
    print("| sampler | one draw, 64 x 49,152 (ms) | sampling phase (s) | tokens | tokens/s |\n|---|---|---|---|---|")
    for name in SAMPLERS:
        seconds = statistics.median(s for s, _ in phase[name])
        tokens = statistics.median(t for _, t in phase[name])
        print(f"| {name} | {1e3 * statistics.median(draw[name]):.1f} | {seconds:.2f} | {tokens:.0f} | "
              f"{tokens / seconds:.0f} |")  # fmt: skip
    ratio = statistics.median(s for s, _ in phase["multinomial"]) / statistics.median(
        s for s, _ in phase["inverse_cdf"]
    )
    print(f"\nsampling phase: multinomial / inverse_cdf = {ratio:.2f}x")


if __name__ == "__main__":
    main()
