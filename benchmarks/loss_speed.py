"""Speed and memory of the GPPO loss per estimator, against the plain PPO clip loss.

Each case runs the part of a training step that the objective owns: from the policy's logits
[N, V] (a leaf, as the LM head would produce) to log-probs, the loss, and backward into the
logits. The baseline is a five-line PPO clip loss measured in the same run. Every case runs in
a fresh subprocess so that its peak memory can be read on its own (CUDA: max_memory_allocated;
CPU: peak RSS, reset after the warm-up step on Linux). "extra MiB" is the peak of the timed
steps above the memory held before them (steady state: what each training step adds);
"warm-up MiB" is the first step's peak above the memory after set-up, which also holds one-time
costs such as building the fused (torch.compile'd) vocabulary pass of `full` (about 150 MiB of
compiler state on CPU that stays for the process; "warm-up s" is that step's time). Ratios > 1
mean slower / more memory than the baseline.

    python benchmarks/loss_speed.py                      # CPU-sized default: N=8192, V=32768
    python benchmarks/loss_speed.py --tokens 32768 --vocab 32768 152064 --device cuda
    python benchmarks/loss_speed.py --tokens 2048 --cases ppo-baseline full --divergences tv kl chi2

The estimator cases run once per divergence of `--divergences` (TV by default): the closed form
of `full` (`Divergence.full_divergence`) is divergence-specific. "ms" is the median of
`--repeats` steps after a warm-up; "time ratio" divides it by the median of PPO baseline steps
timed in the same process, alternating with the case's, so that both see the same load on a
shared machine (absolute times across runs are not comparable there).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = ["ppo-baseline", "sample", "cell", "binary", "topk", "topp", "full"]


def _status_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process in KiB (Linux), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: /proc/self/clear_refs); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def run_case(case: str, tokens: int, vocab: int, top_k: int, device: str, repeats: int, divergence: str = "tv") -> dict:
    import torch

    import gppo

    # Built chunk by chunk so that the set-up's own peak stays below the step's (CPU peak RSS).
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids, logp_behavior, top_logq, top_ids, full_rows = [], [], [], [], []
    for rows in torch.arange(tokens).split(1024):
        log_mu = torch.log_softmax(torch.randn(len(rows), vocab, generator=gen), -1).to(device)
        sampled = torch.multinomial(log_mu.exp(), 1).squeeze(-1)
        ids.append(sampled)
        logp_behavior.append(log_mu.gather(-1, sampled[:, None]).squeeze(-1))
        values, indices = log_mu.topk(top_k, -1)
        top_logq.append(values)
        top_ids.append(indices)
        if case == "full":
            full_rows.append(log_mu)
    ids, logp_behavior, top_logq, top_ids = (torch.cat(x) for x in (ids, logp_behavior, top_logq, top_ids))
    full_behavior = torch.cat(full_rows) if case == "full" else None
    del full_rows
    logits = torch.empty(tokens, vocab, device=device)
    for rows in torch.arange(tokens).split(1024):
        logits[rows] = 0.1 * torch.randn(len(rows), vocab, generator=gen).to(device)
    logits.requires_grad_(True)
    adv = torch.randn(tokens // 256 + 1, generator=gen).to(device).repeat_interleave(256)[:tokens]
    mask = torch.ones(tokens, device=device)

    def step(case=case):
        log_pi = torch.log_softmax(logits.float(), -1)
        logp, topk_logp = gppo.gather_logp(log_pi, ids, top_ids if case in ("topk", "topp") else None)
        if case == "ppo-baseline":
            ratio = torch.exp(logp - logp_behavior)
            loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
        else:
            batch = gppo.TokenBatch(
                logp=logp[None],
                logp_behavior=logp_behavior[None],
                advantages=adv[None],
                mask=mask[None],
                token_ids=ids[None],
                topk_ids=top_ids[None],
                topk_logp_behavior=top_logq[None],
                topk_logp=topk_logp[None] if topk_logp is not None else None,
                logits=logits[None] if case == "full" else None,
                logp_behavior_full=full_behavior[None] if case == "full" else None,
            )
            uses_k = "top_k" in gppo.ESTIMATORS[case].params
            cfg = gppo.preset(
                "dppo-topk-tv", divergence=divergence, estimator=case, **({"top_k": top_k} if uses_k else {})
            )
            loss, _ = gppo.policy_loss(batch, cfg)
        loss.backward()
        logits.grad = None

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    cuda = device.startswith("cuda")
    linux = not cuda and _reset_peak_rss() and _status_kib("VmRSS") is not None

    def peak() -> int:  # bytes
        if cuda:
            return torch.cuda.max_memory_allocated()
        if linux:
            return _status_kib("VmHWM") * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        elif linux:
            _reset_peak_rss()

    sync()
    base = torch.cuda.memory_allocated() if cuda else (_status_kib("VmRSS") * 1024 if linux else peak())
    reset()
    start = time.perf_counter()
    step()  # warm-up
    sync()
    warm_seconds, warm_extra = time.perf_counter() - start, peak() - base
    if linux:  # what stays after the first step (compiler state, caches) is not a per-step cost
        base = _status_kib("VmRSS") * 1024
    reset()  # without /proc (not Linux) the steady-state peak still holds the warm-up's
    step()
    sync()
    extra = peak() - base

    def timed(which) -> float:
        start = time.perf_counter()
        step(which)
        sync()
        return time.perf_counter() - start

    # Timing: the case alternates with the PPO baseline in this process, so that both see the
    # same load; the time ratio is the ratio of their medians.
    timed("ppo-baseline")
    pairs = [(timed("ppo-baseline"), timed(case)) for _ in range(repeats)]
    name = case if case == "ppo-baseline" else f"{case}/{divergence}"
    return {
        "case": name,
        "seconds": statistics.median(t for _, t in pairs),
        "baseline_seconds": statistics.median(b for b, _ in pairs),
        "extra_bytes": max(extra, 0),
        "warm_seconds": warm_seconds,
        "warm_extra_bytes": max(warm_extra, 0),
        "logits_bytes": tokens * vocab * 4,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="B*T tokens per batch")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768])
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=CASES,
        choices=CASES,
        help="cases to run (ppo-baseline always runs first, as the reference)",
    )
    parser.add_argument("--divergences", nargs="+", default=["tv"])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    parser.add_argument("--divergence", default="tv", help=argparse.SUPPRESS)
    parser.add_argument("--one-vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        import torch

        torch.set_num_threads(args.threads)
        print(
            json.dumps(
                run_case(args.case, args.tokens, args.one_vocab, args.top_k, args.device, args.repeats, args.divergence)
            )
        )
        return
    cases = ["ppo-baseline"] + [c for c in args.cases if c != "ppo-baseline"]
    for vocab in args.vocab:
        print(f"\nN={args.tokens} tokens, V={vocab}, K={args.top_k}, device={args.device}")
        print(
            f"{'case':<18}{'ms':>10}{'time ratio':>12}{'extra MiB':>12}{'mem ratio':>11}"
            f"{'extra/logits':>14}{'warm-up s':>11}{'warm-up MiB':>13}"
        )
        rows = []
        for case in cases:
            for div in ["tv"] if case == "ppo-baseline" else args.divergences:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--case",
                        case,
                        "--divergence",
                        div,
                        "--tokens",
                        str(args.tokens),
                        "--one-vocab",
                        str(vocab),
                        "--top-k",
                        str(args.top_k),
                        "--device",
                        args.device,
                        "--repeats",
                        str(args.repeats),
                        "--threads",
                        str(args.threads),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        base = rows[0]
        for row in rows:
            print(
                f"{row['case']:<18}{row['seconds'] * 1e3:>10.1f}{row['seconds'] / row['baseline_seconds']:>12.3f}"
                f"{row['extra_bytes'] / 2**20:>12.0f}{row['extra_bytes'] / max(base['extra_bytes'], 1):>11.2f}"
                f"{row['extra_bytes'] / row['logits_bytes']:>14.2f}{row['warm_seconds']:>11.1f}"
                f"{row['warm_extra_bytes'] / 2**20:>13.0f}"
            )


if __name__ == "__main__":
    main()
