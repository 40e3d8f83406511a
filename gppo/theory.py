"""Theory of the design space (docs/design.md section 7): improvement bounds and trust-region geometry.

- `improvement_bound`: the lower bound on J(pi) - J(mu) that a D_f trust region of radius delta
  guarantees, through TV <= phi_f^-1(delta) (each divergence's `tv_bound`), for the discounted
  TRPO/Achiam bound or DPPO's finite-horizon bound (Thm 3.2 of 2602.04879).
- `ratio_interval` / `geometry`: the interval of r = pi/mu a token of probability q may reach
  within radius delta under the sample, cell and binary estimators ("distinct geometries").
- `matched_radii`: the radii of any divergence x estimator that allow the same movement as a TV
  radius at q = 0.5, to compare divergences at equal strength (`gppo sweep`, `probe`, `geometry`).
"""

from __future__ import annotations

import numpy as np
import torch

from gppo.core.divergences import Divergence, divergence as _divergence
from gppo.core.estimators import binary_estimate
from gppo.core.regions import ratio_interval as _ratio_interval


def _div(div: str | Divergence, **params) -> Divergence:
    return div if isinstance(div, Divergence) else _divergence(div, **params)


def tv_radius(div: str | Divergence, delta: float) -> float:
    """Largest per-state TV distance compatible with D_f <= delta."""
    return _div(div).tv_bound(delta)


def trpo_penalty(tv_max: float, xi: float, gamma: float) -> float:
    """2 xi gamma / (1 - gamma)^2 * TV_max^2 (Schulman et al. 2015; Achiam et al. 2017)."""
    if not 0 <= gamma < 1:
        raise ValueError(f"the discounted bound needs 0 <= gamma < 1 (got {gamma})")
    return 2 * xi * gamma / (1 - gamma) ** 2 * tv_max**2


def dppo_penalty(tv_max: float, xi: float, horizon: int) -> float:
    """min(2 xi T (T-1) TV_max^2, 4 xi sum_t E TV_t) with E TV_t <= TV_max (DPPO Thm 3.2, gamma=1)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 (got {horizon})")
    return min(2 * xi * horizon * (horizon - 1) * tv_max**2, 4 * xi * horizon * tv_max)


def improvement_bound(div: str | Divergence, delta: float, xi: float, *, horizon: int | None = None,
                      gamma: float | None = None, surrogate: float = 0.0) -> float:
    """Lower bound on J(pi) - J(mu): surrogate - penalty(TV <= phi_f^-1(delta)).

    Give `horizon` (finite horizon, gamma = 1: DPPO's bound) or `gamma` (TRPO's bound); xi = max|A|.
    """
    if (horizon is None) == (gamma is None):
        raise ValueError("give exactly one of horizon (finite-horizon bound) or gamma (discounted)")
    tv = tv_radius(div, delta)
    penalty = dppo_penalty(tv, xi, horizon) if horizon is not None else trpo_penalty(tv, xi, gamma)
    return surrogate - penalty


def ratio_interval(div: str | Divergence, estimator: str, q, delta_low: float,
                   delta_high: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] of r = p/q allowed within the radii for tokens of probability q (numpy float64).

    sample: f~(r) <= delta (the same for every q); cell: q f~(r) <= delta;
    binary: D_f({p, 1-p} || {q, 1-q}) <= delta. hi never exceeds 1/q.
    """
    delta_high = delta_low if delta_high is None else delta_high
    q = torch.as_tensor(np.asarray(q, dtype=np.float64))
    if not ((q > 0) & (q <= 1)).all():
        raise ValueError("q must lie in (0, 1]")
    lo, hi = _ratio_interval(_div(div), estimator, q, delta_low, delta_high)
    return lo.numpy(), hi.numpy()


def geometry(divergences, estimators, q, delta: float | dict) -> dict:
    """{(divergence, estimator): (lo, hi)} over the probabilities q; delta a float or a per-divergence dict."""
    out = {}
    for name in divergences:
        radius = delta[name] if isinstance(delta, dict) else delta
        for est in estimators:
            out[(name, est)] = ratio_interval(name, est, q, radius)
    return out


def estimate_at_ratio(div: str | Divergence, estimator: str, q, ratio) -> np.ndarray:
    """The estimate D-hat of a token of probability q whose ratio moved to r (sample, cell, binary)."""
    div = _div(div)
    q = torch.as_tensor(np.asarray(q, dtype=np.float64))
    ratio = torch.as_tensor(np.asarray(ratio, dtype=np.float64))
    if estimator == "sample":
        value = div.f_normalized(ratio)
    elif estimator == "cell":
        value = div.cell_terms(torch.log(q * ratio), torch.log(q))
    elif estimator == "binary":
        value = binary_estimate(div, torch.log(q * ratio), torch.log(q))
    else:
        raise ValueError(f"estimator {estimator!r} is not a function of the sampled token's ratio alone")
    return value.numpy()


REFERENCE_Q = 0.5


def matched_radii(div: str | Divergence, estimator: str, delta: float) -> tuple[float, float]:
    """(delta_low, delta_high) of `div` under `estimator` that allow the same movement as a TV
    radius `delta` does for a token of probability q = 0.5: the ratio interval [1 - 2 delta,
    1 + 2 delta] (there 1/2 |r - 1| <= delta and |p - q| <= delta coincide; PPO's eps = 2 delta).

    The boundary of {D-hat <= radius} is where D-hat = radius, so each radius is the estimate at a
    reference boundary ratio. Estimators without a ratio interval (topk, topp, full) get the binary
    radii: their partitions refine {a, rest}, so their estimate is >= binary's and they never allow
    more movement at the same radius."""
    if not 0 < delta < 0.5:
        raise ValueError(f"delta must be in (0, 0.5) (got {delta}): it is a TV radius at q = 0.5, whose ratio "
                         "interval [1 - 2 delta, 1 + 2 delta] must keep r > 0")
    est = estimator if estimator in ("sample", "cell", "binary") else "binary"
    return tuple(float(estimate_at_ratio(div, est, [REFERENCE_Q], [1 + side * 2 * delta])[0]) for side in (-1, 1))
