"""Cost of a divergence registered from its generator alone, against a built-in closed form.

A registered divergence computes its cell terms in float64 from the generator
(gppo.core.registered_divergences.GeneratorDivergence); the built-ins use float32-stable closed forms. This times D_f over the whole
vocabulary (what the `full` estimator computes per token) for the built-in chi2, the same generator
registered by hand, and triangular discrimination, plus the first (uncached) call of the tight TV
bound that gppo.theory uses.

    python benchmarks/registered_divergence.py                 # N=512, V=32768, one thread
    python benchmarks/registered_divergence.py --tokens 2048 --vocab 152064 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gppo


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gppo.register_divergence("chi2-generator", lambda t: (t - 1) ** 2)
    gppo.register_divergence("triangular", lambda t: (t - 1) ** 2 / (t + 1))
    gen = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(args.tokens, args.vocab, generator=gen), -1)
    log_q = torch.log_softmax(torch.randn(args.tokens, args.vocab, generator=gen), -1)
    base = None
    print(f"D_f over the vocabulary, float32 inputs [{args.tokens}, {args.vocab}], {args.threads} thread(s)")
    for name in ("chi2", "chi2-generator", "triangular"):
        div = gppo.divergence(name)
        seconds = timed(lambda div=div: div.between_log(log_p, log_q), args.repeats)
        base = base or seconds
        start = time.perf_counter()
        div.tv_bound(0.05)
        bound = time.perf_counter() - start
        print(f"  {name:15s} {seconds:7.3f} s  ({seconds / base:4.2f}x chi2)   tv_bound(0.05) first call {bound:.3f} s")


if __name__ == "__main__":
    main()
