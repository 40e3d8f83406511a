"""Trust regions as ratio intervals: the r = p/q a token may reach within radius delta.

For an estimator whose value depends only on the sampled token's p and q (sample, cell, binary,
or any registered with per_token=True), the region {D-hat <= delta} is an interval [lo, hi]
around r = 1 because D-hat is convex in r with its minimum 0 at r = 1. This is what the
clip-style rules clip to, and what `gppo.theory` plots as the geometry of a divergence (PPO:
constant; RIPO: |r-1| <= sqrt(delta/q); binary TV: |r-1| <= delta/q). Each estimator's
`ratio_interval` (gppo.core.estimators) picks one of the functions below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gppo.core.divergences import Divergence


@functools.lru_cache(maxsize=256)
def sample_interval(div: Divergence, delta_low: float, delta_high: float) -> tuple[float, float]:
    """[lo, hi] of the single-sample estimate f~(r) <= delta (independent of q)."""
    lo, _ = div.normalized_inverse(torch.tensor(float(delta_low), dtype=torch.float64))
    _, hi = div.normalized_inverse(torch.tensor(float(delta_high), dtype=torch.float64))
    return float(lo), float(hi)


def cell_interval(div: Divergence, q: torch.Tensor, delta_low, delta_high):
    """[lo, hi] of the cell estimate: q f~(r) <= delta  <=>  f~(r) <= delta / q."""
    lo, _ = div.normalized_inverse(delta_low / q)
    _, hi = div.normalized_inverse(delta_high / q)
    return lo, hi


def _bisect(fn, inside, outside, delta, steps=80):
    """Boundary of {fn(x) <= delta} between an inside point and an outside point (per element)."""
    for _ in range(steps):
        mid = (inside + outside) / 2
        ok = fn(mid) <= delta
        inside, outside = torch.where(ok, mid, inside), torch.where(ok, outside, mid)
    return inside


def bisect_interval(token_estimate: Callable, q: torch.Tensor, delta_low, delta_high):
    """[lo, hi] of {token_estimate(log q + u, log q) <= delta} by bisection on u = log r (the lower
    bound can be astronomically small); hi never exceeds 1/q. q is float64."""
    log_q = torch.log(q)

    def fn(log_ratio):  # the estimate of the token once its ratio is exp(log_ratio)
        return token_estimate(log_q + log_ratio, log_q)

    zero, log_cap = torch.zeros_like(q), -log_q
    floor = torch.full_like(q, -745.0)  # exp(-745) underflows to r = 0
    lo = torch.where(fn(floor) <= delta_low, zero, _bisect(fn, zero, floor, delta_low).exp())
    hi = torch.where(fn(log_cap) <= delta_high, 1.0 / q, _bisect(fn, zero, log_cap, delta_high).exp())
    return lo, hi


DCPO_MAX_RATIO = 10.0  # DCPO's official code (lime-RL/DCPO, get_clip_low_high) caps hi at 10


def dcpo_interval(q: torch.Tensor, eps_low: float, eps_high: float):
    """DCPO's bounds 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0)) <= r <= min(0.5 + 0.5 sqrt(1 +
    4 eps_high / q), 10) (Yang et al. 2025, 2509.02333): |r - 1| r q <= eps on each side, the upper
    bound capped at DCPO_MAX_RATIO as in the authors' code (without it a token of q = 1e-6 could
    reach r = 447)."""
    q = torch.as_tensor(q, dtype=torch.float64)
    lo = 0.5 + 0.5 * torch.sqrt((1 - 4 * eps_low / q).clamp(min=0.0))
    hi = (0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high / q)).clamp(max=DCPO_MAX_RATIO)
    return lo, hi
