"""Theory of the design space (docs/design.md section 7): improvement bounds and trust-region geometry.

- `improvement_bound`: the lower bound on J(pi) - J(mu) that a D_f trust region of radius delta
  guarantees, through TV <= phi_f^-1(delta) (each divergence's `tv_bound`). Three bounds, each
  implemented exactly as its source states it, with its own advantage constant:
    bound="dppo", gamma:   DPPO (2602.04879) Theorem 2.1, after Schulman et al. 2015 and Achiam
                           et al. 2017:  L - 2 xi gamma / (1 - gamma)^2 * TV_max^2;
    bound="dppo", horizon: DPPO Theorem 3.2 (finite horizon T, gamma = 1):
                           L - min(2 xi T (T - 1) TV_max^2, 4 xi T TV_max)  (E TV_t <= TV_max);
    bound="trpo", gamma:   TRPO (Schulman et al. 2015) Theorem 1:
                           L - 4 eps gamma / (1 - gamma)^2 * alpha^2, alpha = TV_max, eps = max_{s,a} |A|.
  xi is DPPO's advantage constant, the largest expected advantage max_s |E_{a~pi} A_mu(s, a)|;
  eps (passed as `xi` with bound="trpo") is the largest absolute advantage. Since xi <= eps, the
  DPPO form is the tighter of the two discounted bounds.
- `ratio_interval` / `geometry`: the interval of r = pi/mu a token of probability q may reach
  within radius delta under the sample, cell and binary estimators ("distinct geometries").
- `matched_radii`: the radii of any divergence x estimator that allow the same movement as a TV
  radius at q = 0.5, to compare divergences at equal strength (`gppo sweep`, `probe`, `geometry`).
"""

from __future__ import annotations

import numpy as np
import torch

from gppo.core import ESTIMATORS, Divergence
from gppo.core import divergence as _divergence


def _div(div: str | Divergence, **params) -> Divergence:
    return div if isinstance(div, Divergence) else _divergence(div, **params)


def tv_radius(div: str | Divergence, delta: float) -> float:
    """Largest per-state TV distance compatible with D_f <= delta."""
    return _div(div).tv_bound(delta)


def _check_gamma(gamma: float) -> None:
    if not 0 <= gamma < 1:
        raise ValueError(f"the discounted bound needs 0 <= gamma < 1 (got {gamma})")


def trpo_penalty(tv_max: float, eps: float, gamma: float) -> float:
    """4 eps gamma / (1 - gamma)^2 * alpha^2, alpha = TV_max, eps = max_{s,a} |A| (TRPO Theorem 1)."""
    _check_gamma(gamma)
    return 4 * eps * gamma / (1 - gamma) ** 2 * tv_max**2


def dppo_discounted_penalty(tv_max: float, xi: float, gamma: float) -> float:
    """2 xi gamma / (1 - gamma)^2 * TV_max^2, xi = max_s |E_{a~pi} A_mu(s, a)| (DPPO Theorem 2.1)."""
    _check_gamma(gamma)
    return 2 * xi * gamma / (1 - gamma) ** 2 * tv_max**2


def dppo_penalty(tv_max: float, xi: float, horizon: int) -> float:
    """min(2 xi T (T-1) TV_max^2, 4 xi sum_t E TV_t) with E TV_t <= TV_max (DPPO Theorem 3.2, gamma = 1)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 (got {horizon})")
    return min(2 * xi * horizon * (horizon - 1) * tv_max**2, 4 * xi * horizon * tv_max)


def improvement_bound(
    div: str | Divergence,
    delta: float,
    xi: float,
    *,
    horizon: int | None = None,
    gamma: float | None = None,
    surrogate: float = 0.0,
    bound: str = "dppo",
) -> float:
    """Lower bound on J(pi) - J(mu): surrogate - penalty(TV <= phi_f^-1(delta)) (module docstring).

    bound="dppo": give `horizon` (Theorem 3.2) or `gamma` (Theorem 2.1), xi = max_s |E_pi A|;
    bound="trpo": give `gamma` (TRPO Theorem 1), xi = max_{s,a} |A|.
    """
    if (horizon is None) == (gamma is None):
        raise ValueError("give exactly one of horizon (finite-horizon bound) or gamma (discounted)")
    if bound not in ("dppo", "trpo"):
        raise ValueError(f"bound={bound!r}: choose 'dppo' (DPPO Theorems 2.1 / 3.2) or 'trpo' (TRPO Theorem 1)")
    if bound == "trpo" and horizon is not None:
        raise ValueError("bound='trpo' is TRPO's discounted Theorem 1: give gamma, not horizon")
    tv = tv_radius(div, delta)
    if horizon is not None:
        penalty = dppo_penalty(tv, xi, horizon)
    elif bound == "trpo":
        penalty = trpo_penalty(tv, xi, gamma)
    else:
        penalty = dppo_discounted_penalty(tv, xi, gamma)
    return surrogate - penalty


def ratio_interval(
    div: str | Divergence, estimator: str, q, delta_low: float, delta_high: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] of r = p/q allowed within the radii for tokens of probability q (numpy float64).

    sample: f~(r) <= delta (the same for every q); cell: q f~(r) <= delta;
    binary: D_f({p, 1-p} || {q, 1-q}) <= delta. hi never exceeds 1/q.
    """
    delta_high = delta_low if delta_high is None else delta_high
    q = torch.as_tensor(np.asarray(q, dtype=np.float64))
    if not ((q > 0) & (q <= 1)).all():
        raise ValueError("q must lie in (0, 1]")
    lo, hi = ESTIMATORS.lookup(estimator).ratio_interval(_div(div), q, delta_low, delta_high)
    return lo.numpy(), hi.numpy()


def ratio_interval_estimators() -> list[str]:
    """The registered estimators whose trust region is a ratio interval (sample, cell, binary, ...)."""
    return [name for name, est in ESTIMATORS.items() if est.has_ratio_interval]


def geometry(divergences, estimators, q, delta: float | dict) -> dict:
    """{(divergence, estimator): (lo, hi)} over the probabilities q; delta a float or a per-divergence dict."""
    out = {}
    for name in divergences:
        radius = delta[name] if isinstance(delta, dict) else delta
        for est in estimators:
            out[(name, est)] = ratio_interval(name, est, q, radius)
    return out


def estimate_at_ratio(div: str | Divergence, estimator: str, q, ratio) -> np.ndarray:
    """The estimate D-hat of a token of probability q whose ratio moved to r (estimators with a
    ratio interval: sample, cell, binary, or any registered per token)."""
    est = ESTIMATORS.lookup(estimator)
    if not est.has_ratio_interval:
        raise ValueError(f"estimator {estimator!r} is not a function of the sampled token's ratio alone")
    div = _div(div)
    q = torch.as_tensor(np.asarray(q, dtype=np.float64))
    ratio = torch.as_tensor(np.asarray(ratio, dtype=np.float64))
    return est.token_estimate(div, torch.log(q * ratio), torch.log(q)).numpy()


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
        raise ValueError(
            f"delta must be in (0, 0.5) (got {delta}): it is a TV radius at q = 0.5, whose ratio "
            "interval [1 - 2 delta, 1 + 2 delta] must keep r > 0"
        )
    est = estimator if ESTIMATORS.lookup(estimator).has_ratio_interval else "binary"
    return tuple(float(estimate_at_ratio(div, est, [REFERENCE_Q], [1 + side * 2 * delta])[0]) for side in (-1, 1))
