"""Divergences known only by their convex generator f: `register_divergence` derives the constants
numerically (f'(1), f''(1), the limits f~(0) and lim f~(t)/t) and the tight TV bound of Vajda's
curve, which the built-ins of gppo.core.divergences state in closed form (docs/design.md section 2).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, make_dataclass

import torch

from gppo.core.divergences import DIVERGENCES, Divergence


@dataclass(frozen=True, repr=False)
class GeneratorDivergence(Divergence):
    """A divergence known only by its generator f (`register_divergence`); the numerics are derived.

    Cell terms q f(p/q) - f'(1)(p - q) are computed in float64 from log-probabilities (t = p/q
    overflowing to inf gives the limit p * slope_at_inf, underflowing to 0 the limit q * f~(0)).
    tv_bound inverts Vajda's tight lower bound
    L(V) = min over two-point pairs with TV = V of D_f (`vajda_tv_bound`); normalized_inverse is the
    generic bisection.
    """

    generator: Callable | None = None

    def _interior(self, p, q, log_p, log_q):
        p64, q64 = p.double(), q.double()
        t = torch.exp(log_p.double() - log_q.double())
        value = q64 * self.generator(t) - self.f_prime_at_1 * (p64 - q64)
        value = torch.where(torch.isinf(t), p64 * self.slope_at_inf, value)
        value = torch.where(t == 0, q64 * self.f_tilde_at_0, value)
        return value.to(p.dtype)

    def tv_bound(self, delta):
        return vajda_tv_bound(self, float(delta))


def _binary_divergence(div: Divergence, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """D_f({q + v, 1 - q - v} || {q, 1 - q}) in float64."""
    p = q + v
    return div.cell_terms(torch.log(p), torch.log(q)) + div.cell_terms(torch.log1p(-p), torch.log1p(-q))


def vajda_curve(div: Divergence, v: torch.Tensor, steps: int = 64) -> torch.Tensor:
    """L(V) = inf { D_f(P || Q) : TV(P, Q) = V }, elementwise for V in [0, 1] (float64).

    Merging the cells {P > Q} and {P <= Q} keeps TV = V and cannot raise D_f (data processing), so
    the infimum is over two-point pairs (Vajda 1972; Gilardoni 2010): q -> D_f(q + V || q) on
    [0, 1 - V], convex in q because D_f is jointly convex; golden-section search finds its minimum.
    """
    v = torch.as_tensor(v, dtype=torch.float64)
    lo, hi = torch.zeros_like(v), 1.0 - v
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(steps):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        at_a, at_b = _binary_divergence(div, torch.stack([a, b]), v.expand(2, *v.shape))
        left_lower = at_a <= at_b
        lo, hi = torch.where(left_lower, lo, a), torch.where(left_lower, b, hi)
    candidates = torch.stack([(lo + hi) / 2, torch.zeros_like(v), 1.0 - v])
    return _binary_divergence(div, candidates, v.expand_as(candidates)).min(0).values


@functools.lru_cache(maxsize=1024)
def vajda_tv_bound(div: Divergence, delta: float, rounds: int = 5, points: int = 1024) -> float:
    """sup { V : L(V) <= delta }: the largest TV that D_f <= delta allows, tight (L is convex and
    non-decreasing). Grid refinement: each round keeps the grid cell where L crosses delta;
    returns its upper end (the safe side), accurate to about 1024^-5 = 1e-15."""
    if not delta >= 0:
        raise ValueError(f"a TV bound needs delta >= 0 (got {delta})")
    if float(vajda_curve(div, torch.tensor([1.0]))[0]) <= delta:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(rounds):
        grid = torch.linspace(lo, hi, points + 1, dtype=torch.float64)
        inside = vajda_curve(div, grid) <= delta
        last = int(inside.nonzero().max())  # grid[0] = lo is inside, grid[-1] = hi is not
        lo, hi = float(grid[last]), float(grid[last + 1])
    return hi


def _derivatives_at_one(f: Callable) -> tuple[float, float]:
    """(f'(1), f''(1)) by autograd, float64."""
    t = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    (first,) = torch.autograd.grad(f(t), t, create_graph=True)
    second = torch.autograd.grad(first, t)[0] if first.requires_grad else torch.zeros(())
    return float(first.detach()), float(second)


def _limit(values: torch.Tensor) -> float:
    """The limit of a monotone sequence sampled far out (last two values): the last value when they
    agree to 1e-9, +inf when they keep growing."""
    a, b = float(values[-2]), float(values[-1])
    if math.isfinite(b) and abs(b - a) <= 1e-9 * max(1.0, abs(b)):
        return b
    return math.inf


def register_divergence(
    name: str, f: Callable, *, f_prime_at_1: float | None = None, summary: str = ""
) -> type[Divergence]:
    """Register the f-divergence with convex generator `f` (a torch function of t >= 0, f(1) = 0).

    It becomes usable everywhere a divergence name is: every estimator and rule, preset overrides,
    `gppo train --divergence NAME` and `gppo.theory`. Derived numerically in float64: f'(1) by
    autograd (give `f_prime_at_1` where f has a kink at 1; any subgradient works), f''(1), the
    limits f~(0) and lim f~(t)/t as t -> inf (from f at t = 0, else at t -> 0 / inf; either may
    be inf), the tight TV bound (`vajda_tv_bound`) and the ratio inverse (bisection).
    Returns the registered class (`gppo.divergence(name)` builds it).
    """
    DIVERGENCES.check_new(name)
    if not callable(f):
        raise TypeError(f"register_divergence({name!r}, f): f must be a torch function of t, got {type(f).__name__}")
    with torch.no_grad():
        at_one = float(f(torch.tensor(1.0, dtype=torch.float64)))
    if not abs(at_one) <= 1e-12:
        raise ValueError(f"divergence {name!r}: f(1) must be 0 (got {at_one}); use f(t) - f(1)")
    slope, curvature = _derivatives_at_one(f)
    slope = slope if f_prime_at_1 is None else float(f_prime_at_1)
    if not math.isfinite(slope):
        raise ValueError(
            f"divergence {name!r}: f'(1) is not finite by autograd ({slope}); pass "
            "f_prime_at_1 (any subgradient of f at 1)"
        )
    with torch.no_grad():
        t = torch.logspace(-8, 8, 321, dtype=torch.float64)
        f_tilde = f(t) - slope * (t - 1)
        if not torch.isfinite(f_tilde).all():
            raise ValueError(f"divergence {name!r}: f(t) is not finite for some t in [1e-8, 1e8]")
        chord = f_tilde.diff() / t.diff()  # non-decreasing for a convex f
        concave = chord.diff() < -1e-7 * (chord[1:].abs() + chord[:-1].abs() + 1e-12)
        if concave.any() or (f_tilde < -1e-9 * (1 + f_tilde.abs())).any():
            bad = float(t[1:-1][concave][0]) if concave.any() else float(t[f_tilde.argmin()])
            raise ValueError(
                f"divergence {name!r}: f is not convex near t = {bad:.3g} (or "
                f"f'(1) = {slope} is not a subgradient at 1); an f-divergence needs a "
                "convex generator"
            )
        at_zero = float(f(torch.zeros((), dtype=torch.float64))) + slope
        if math.isnan(at_zero):
            tiny = torch.tensor([1e-150, 1e-300], dtype=torch.float64)
            at_zero = _limit(f(tiny) - slope * (tiny - 1))
        huge = torch.tensor([1e50, 1e100], dtype=torch.float64)
        slope_at_inf = _limit(f(huge) / huge - slope)
    cls = make_dataclass(
        f"Registered_{name}",
        [
            ("name", str, name),
            ("generator", Callable, f),
            ("f_prime_at_1", float, slope),
            ("curvature", float, curvature if math.isfinite(curvature) and curvature > 0 else None),
            ("f_tilde_at_0", float, at_zero),
            ("slope_at_inf", float, slope_at_inf),
        ],
        bases=(GeneratorDivergence,),
        frozen=True,
        repr=False,
        namespace={"summary": summary or f"registered generator {getattr(f, '__name__', 'f')}"},
    )
    DIVERGENCES.add(name, cls)
    return cls
