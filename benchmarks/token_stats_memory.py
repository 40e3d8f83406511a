"""Peak memory of the training forward + backward that scores tokens: the plain path against
`gppo.token_stats`.

    plain:        logits = hidden @ W.T for all n rows, .float() / T, log_softmax, gather, backward
    token_stats:  the same log pi(a) (and its gradient) one chunk of rows at a time

Each (path, n) runs in a fresh subprocess so that its peak is its own: on CPU the peak RSS
(resource.getrusage ru_maxrss) minus the RSS after set-up (the weight, the hidden states, torch
itself); on CUDA torch.cuda.max_memory_allocated minus the memory allocated after set-up. The
loss is sum_t log pi(a_t) (+ the entropy with --entropy); hidden and weight both get gradients.
"ratio" divides the plain path's extra peak by token_stats'. About a minute on two CPU cores:

    python benchmarks/token_stats_memory.py
    python benchmarks/token_stats_memory.py --tokens 8192 16384 --hidden 4096 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

PATHS = ("plain", "token_stats")


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc/self/status VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: the CPU measurement needs Linux")


def run_one(
    path: str, tokens: int, vocab: int, hidden_size: int, device: str, dtype: str, entropy: bool, temperature: float
) -> dict:
    """One forward + backward of `path` in this process: its extra peak memory and its time."""
    import torch

    import gppo

    torch.manual_seed(0)
    dtype_ = getattr(torch, dtype)
    weight = (0.05 * torch.randn(vocab, hidden_size, device=device)).to(dtype_).requires_grad_()
    hidden = torch.randn(tokens, hidden_size, device=device).to(dtype_).requires_grad_()
    token_ids = torch.randint(0, vocab, (tokens,), device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    if path == "plain":
        log_pi = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
        loss = log_pi.gather(1, token_ids[:, None]).sum()
        if entropy:
            loss = loss - (log_pi.exp() * log_pi).sum()
    else:
        stats = gppo.token_stats(hidden, weight, token_ids, temperature=temperature, entropy=entropy)
        loss = stats.logp.sum() + (stats.entropy.sum() if entropy else 0.0)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"path": path, "tokens": tokens, "extra_mib": (peak - base) / 2**20, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="of the weight and hidden states")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--entropy", action="store_true", help="also differentiate the entropy")
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # the subprocess's case
    args = parser.parse_args()
    if args.one:
        print(
            json.dumps(
                run_one(
                    args.one,
                    args.tokens[0],
                    args.vocab,
                    args.hidden,
                    args.device,
                    args.dtype,
                    args.entropy,
                    args.temperature,
                )
            )
        )
        return
    print(
        f"V = {args.vocab}, H = {args.hidden}, {args.dtype} on {args.device}, T = {args.temperature}"
        f"{', loss with entropy' if args.entropy else ''}; extra peak memory of forward + backward"
    )
    print(f"{'n':>7} {'plain MiB':>10} {'token_stats MiB':>16} {'ratio':>7} {'plain s':>8} {'token_stats s':>14}")
    for tokens in args.tokens:
        results = {}
        for path in PATHS:
            command = [
                sys.executable,
                __file__,
                "--one",
                path,
                "--tokens",
                str(tokens),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--temperature",
                str(args.temperature),
            ]
            out = subprocess.run(
                command + (["--entropy"] if args.entropy else []), check=True, capture_output=True, text=True
            ).stdout
            results[path] = json.loads(out.strip().splitlines()[-1])
        plain, chunked = results["plain"], results["token_stats"]
        print(
            f"{tokens:>7} {plain['extra_mib']:>10.0f} {chunked['extra_mib']:>16.0f} "
            f"{plain['extra_mib'] / max(chunked['extra_mib'], 1e-9):>7.1f} {plain['seconds']:>8.2f} "
            f"{chunked['seconds']:>14.2f}"
        )


if __name__ == "__main__":
    main()
