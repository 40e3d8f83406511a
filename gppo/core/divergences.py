"""The divergence axis: f-divergences D_f(pi || mu) = sum_a mu(a) f(pi(a) / mu(a)) (docs/design.md section 2).

Every divergence is defined by its normalised generator f~(t) = f(t) - f'(1)(t - 1) >= 0, which has
the same D_f between probability vectors and is the right single-sample estimate (for KL(mu||pi)
it is Schulman's k3 = r - 1 - log r). One method carries all the numerics:

    cell_terms(log p, log q) = q * f~(p / q)     elementwise, >= 0,

computed from log-probabilities with the limits of the convention 0 * f(0 / 0) = 0:
q = 0 gives p * lim_{t->inf} f~(t) / t, p = 0 gives q * f~(0) (either may be +inf, never NaN).
Everything else (f, f~, D_f between vectors, binary and top-K cells) is built on it. The interior
formulas are free of cancellation near p = q in float32 (e.g. e^x - 1 - x by its series, not by
subtraction). One exception for speed: `full_divergence`, D_f between two whole distributions,
has a closed form per built-in divergence that needs fewer operations per vocabulary cell.
Sources: Sason & Verdu, "f-Divergence Inequalities" (2016); Gilardoni (2010) for the alpha family.

This module holds the base class, the built-in table and the registry; a divergence given by its
generator alone (`register_divergence`, whose constants and TV bound are derived numerically) is in
gppo.core.registered_divergences, the shared float helpers in gppo.core.numerics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from gppo.core.numerics import LOG2, expm1_minus, work_dtype
from gppo.core.registry import Registry


@dataclass(frozen=True)
class Divergence:
    """An f-divergence. Subclasses give the interior cell term and the constants below.

    Attributes:
        name: registry name.
        curvature: f''(1); locally D_f ~ (f''(1) / 2) * chi^2 (None for TV, which is not smooth).
        f_prime_at_1: f'(1), the slope removed by normalisation (0 for TV by convention).
        f_tilde_at_0: f~(0), the cell term's limit when p = 0 (per unit of q).
        slope_at_inf: lim_{t->inf} f~(t) / t, the cell term's limit when q = 0 (per unit of p).
        params: the GPPOConfig fields that parameterise it (dataclass fields of the subclass).
    """

    params: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[str] = ""

    name: str = ""
    curvature: float | None = None
    f_prime_at_1: float = 0.0
    f_tilde_at_0: float = 0.0
    slope_at_inf: float = 0.0

    # --- to implement -----------------------------------------------------------------------
    def _interior(self, p, q, log_p, log_q):
        """q * f~(p / q) for p, q > 0 (tensors of one dtype)."""
        raise NotImplementedError

    def tv_bound(self, delta: float) -> float:
        """Largest total variation compatible with D_f <= delta (docs/design.md section 2 table);
        non-decreasing in delta and at most 1."""
        raise NotImplementedError

    def full_divergence(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """D_f(p || q) over the last axis between two complete distributions (each sums to 1),
        as the `full` estimator needs it. This generic version sums the cell terms; a subclass
        may override it with a closed form that uses sum p = sum q = 1 to make fewer passes over
        the vocabulary (docs/design.md section 8). Closed forms are accurate to a few float32 eps
        in absolute terms, the cell sum to a few eps relative."""
        return self.between_log(log_p, log_q)

    # --- shared numerics ------------------------------------------------------------------
    def cell_terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """Elementwise q * f~(p / q) from log-probabilities; zero cells give their limits."""
        dtype = work_dtype(log_p, log_q)
        log_p, log_q = torch.broadcast_tensors(log_p.to(dtype), log_q.to(dtype))
        p, q = log_p.exp(), log_q.exp()
        interior = (p > 0) & (q > 0)
        # Evaluate the interior formula on safe stand-ins, then patch the boundary limits in.
        safe_log_p = torch.where(interior, log_p, torch.zeros_like(log_p))
        safe_log_q = torch.where(interior, log_q, torch.zeros_like(log_q))
        inside = self._interior(safe_log_p.exp(), safe_log_q.exp(), safe_log_p, safe_log_q)
        zero = torch.zeros_like(p)
        p_zero = torch.where(q > 0, q * self.f_tilde_at_0, zero)  # p = 0 < q
        q_zero = torch.where(p > 0, p * self.slope_at_inf, zero)  # q = 0 < p
        boundary = torch.where(p > 0, q_zero, p_zero)
        return torch.where(interior, inside.clamp(min=0.0), boundary)

    def f_normalized(self, t: torch.Tensor) -> torch.Tensor:
        """f~(t) = f(t) - f'(1)(t - 1) >= 0, with f~(1) = 0."""
        t = torch.as_tensor(t)
        t = t.to(work_dtype(t)) if t.is_floating_point() else t.to(torch.float32)
        return self.cell_terms(torch.log(t), torch.zeros_like(t))

    def f(self, t: torch.Tensor) -> torch.Tensor:
        """The generator f(t) (convex, f(1) = 0)."""
        t = torch.as_tensor(t)
        t = t.to(work_dtype(t)) if t.is_floating_point() else t.to(torch.float32)
        return self.f_normalized(t) + self.f_prime_at_1 * (t - 1.0)

    def between_log(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """D_f(p || q) over the last axis from log-probabilities (-inf marks a zero cell)."""
        return self.cell_terms(log_p, log_q).sum(-1)

    def between(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """D_f(p || q) = sum q * f(p / q) over the last axis, for probability vectors p = pi, q = mu."""
        p, q = torch.as_tensor(p), torch.as_tensor(q)
        return self.between_log(torch.log(p), torch.log(q))

    def normalized_inverse(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) with lo <= 1 <= hi and f~(lo) = f~(hi) = delta: the ratios a single-sample
        estimate allows. lo = 0 when f~(0) <= delta. Generic: bisection in log space."""
        delta = torch.as_tensor(delta, dtype=torch.float64)
        lo = _bisect_log_ratio(self, delta, upper_side=False)
        lo = torch.where(delta >= self.f_tilde_at_0, torch.zeros_like(lo), lo)
        return lo, _bisect_log_ratio(self, delta, upper_side=True)

    def __repr__(self) -> str:
        return f"divergence({self.name!r})"


def _bisect_log_ratio(div: Divergence, delta: torch.Tensor, upper_side: bool, steps: int = 80):
    """Solve f~(exp(u)) = delta for u in [0, 700] (upper side) or [-700, 0] (lower side)."""
    inner = torch.zeros_like(delta)
    outer = torch.full_like(delta, 700.0 if upper_side else -700.0)
    for _ in range(steps):
        mid = (inner + outer) / 2
        inside = div.f_normalized(torch.exp(mid)) <= delta
        inner, outer = torch.where(inside, mid, inner), torch.where(inside, outer, mid)
    return torch.exp((inner + outer) / 2)


def _clamp_tv(x: float) -> float:
    return min(1.0, x)


def _sum_terms(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis of closed-form terms in which a cell with p = q = 0 gave NaN
    (0 * -inf, or -inf - -inf): such a cell contributes 0 (0 f(0/0) = 0); +-inf stay."""
    return torch.nan_to_num_(terms, nan=0.0, posinf=math.inf, neginf=-math.inf).sum(-1)


@dataclass(frozen=True, repr=False)
class TotalVariation(Divergence):
    """f(t) = |t - 1| / 2; D = (1/2) sum |p - q|."""

    name: str = "tv"
    f_tilde_at_0: float = 0.5
    slope_at_inf: float = 0.5

    def _interior(self, p, q, log_p, log_q):
        x = log_p - log_q  # p - q = q expm1(x), exact near p = q where p - q cancels
        return 0.5 * torch.where(x.abs() <= 1, q * torch.expm1(x).abs(), (p - q).abs())

    def tv_bound(self, delta):
        return _clamp_tv(delta)

    def full_divergence(self, log_p, log_q):
        # (1/2) sum |p - q| = 1 - sum min(p, q): one exponential per cell
        return (1 - torch.minimum(log_p, log_q).exp_().sum(-1)).clamp_(min=0.0)

    def normalized_inverse(self, delta):
        delta = torch.as_tensor(delta, dtype=torch.float64)
        return (1 - 2 * delta).clamp(min=0.0), 1 + 2 * delta


@dataclass(frozen=True, repr=False)
class ForwardKL(Divergence):
    """KL(mu || pi): f(t) = -log t, f~(t) = t - 1 - log t (k3)."""

    name: str = "kl"
    curvature: float = 1.0
    f_prime_at_1: float = -1.0
    f_tilde_at_0: float = math.inf
    slope_at_inf: float = 1.0

    def _interior(self, p, q, log_p, log_q):
        x = log_p - log_q
        return torch.where(x.abs() <= 1, q * expm1_minus(x), p - q - q * x)

    def tv_bound(self, delta):
        return _clamp_tv(math.sqrt(delta / 2))  # Pinsker

    def full_divergence(self, log_p, log_q):
        return _sum_terms(log_q.exp() * (log_q - log_p)).clamp_(min=0.0)  # sum q log(q / p)


@dataclass(frozen=True, repr=False)
class ReverseKL(Divergence):
    """KL(pi || mu): f(t) = t log t, f~(t) = t log t - t + 1."""

    name: str = "rkl"
    curvature: float = 1.0
    f_prime_at_1: float = 1.0
    f_tilde_at_0: float = 1.0
    slope_at_inf: float = math.inf

    def _interior(self, p, q, log_p, log_q):
        x = log_q - log_p
        return torch.where(x.abs() <= 1, p * expm1_minus(x), q - p - p * x)

    def tv_bound(self, delta):
        return _clamp_tv(math.sqrt(delta / 2))  # Pinsker

    def full_divergence(self, log_p, log_q):
        return _sum_terms(log_p.exp() * (log_p - log_q)).clamp_(min=0.0)  # sum p log(p / q)


@dataclass(frozen=True, repr=False)
class PearsonChi2(Divergence):
    """Pearson chi^2(pi || mu): f(t) = (t - 1)^2; D = sum (p - q)^2 / q."""

    name: str = "chi2"
    curvature: float = 2.0
    f_tilde_at_0: float = 1.0
    slope_at_inf: float = math.inf

    def _interior(self, p, q, log_p, log_q):
        x = log_p - log_q
        return torch.where(x.abs() <= 1, q * torch.expm1(x) ** 2, (p - q) ** 2 / q)

    def tv_bound(self, delta):
        return _clamp_tv(0.5 * math.sqrt(delta))

    def full_divergence(self, log_p, log_q):
        return (_sum_terms((2 * log_p - log_q).exp_()) - 1).clamp_(min=0.0)  # sum p^2 / q - 1

    def normalized_inverse(self, delta):
        root = torch.as_tensor(delta, dtype=torch.float64).sqrt()
        return (1 - root).clamp(min=0.0), 1 + root


@dataclass(frozen=True, repr=False)
class NeymanChi2(Divergence):
    """Neyman chi^2 = chi^2(mu || pi): f(t) = (t - 1)^2 / t; D = sum (p - q)^2 / p."""

    name: str = "neyman"
    curvature: float = 2.0
    f_tilde_at_0: float = math.inf
    slope_at_inf: float = 1.0

    def _interior(self, p, q, log_p, log_q):
        x = log_q - log_p
        return torch.where(x.abs() <= 1, p * torch.expm1(x) ** 2, (p - q) ** 2 / p)

    def tv_bound(self, delta):
        return _clamp_tv(0.5 * math.sqrt(delta))

    def full_divergence(self, log_p, log_q):
        return (_sum_terms((2 * log_q - log_p).exp_()) - 1).clamp_(min=0.0)  # sum q^2 / p - 1

    def normalized_inverse(self, delta):
        delta = torch.as_tensor(delta, dtype=torch.float64)
        disc = (delta * delta + 4 * delta).sqrt()  # roots of t^2 - (2 + delta) t + 1 = 0
        return (2 + delta - disc) / 2, (2 + delta + disc) / 2


@dataclass(frozen=True, repr=False)
class SquaredHellinger(Divergence):
    """Squared Hellinger: f(t) = (sqrt t - 1)^2; D = sum (sqrt p - sqrt q)^2 in [0, 2]."""

    name: str = "hellinger"
    curvature: float = 0.5
    f_tilde_at_0: float = 1.0
    slope_at_inf: float = 1.0

    def _interior(self, p, q, log_p, log_q):
        x = log_p - log_q
        return torch.where(x.abs() <= 1, q * torch.expm1(x / 2) ** 2, (p.sqrt() - q.sqrt()) ** 2)

    def tv_bound(self, delta):
        h2 = min(delta, 2.0)  # squared Hellinger never exceeds 2, where the bound reaches 1
        return _clamp_tv(math.sqrt(h2 * (1 - h2 / 4)))  # Le Cam: TV <= H sqrt(1 - H^2 / 4)

    def full_divergence(self, log_p, log_q):
        return (2 - 2 * ((log_p + log_q) / 2).exp_().sum(-1)).clamp_(min=0.0)  # 2 - 2 sum sqrt(p q)

    def normalized_inverse(self, delta):
        root = torch.as_tensor(delta, dtype=torch.float64).sqrt()
        return (1 - root).clamp(min=0.0) ** 2, (1 + root) ** 2


@dataclass(frozen=True, repr=False)
class JensenShannon(Divergence):
    """Jensen-Shannon: f(t) = (1/2)[t log(2t / (1 + t)) + log(2 / (1 + t))], in nats."""

    name: str = "js"
    curvature: float = 0.25
    f_tilde_at_0: float = 0.5 * LOG2
    slope_at_inf: float = 0.5 * LOG2

    def _interior(self, p, q, log_p, log_q):
        # (1/2)[p log(2p / (p + q)) + q log(2q / (p + q))]. With u = tanh(x / 2) = (p - q)/(p + q)
        # this is (p + q)/4 [(1 + u) log(1 + u) + (1 - u) log(1 - u)] = (p + q)/4 [x u + log(1 - u^2)]
        # (atanh u = x / 2), free of the O(x) cancellation of the direct form near p = q.
        x = log_p - log_q
        u = torch.tanh(x / 2)
        near = (p + q) / 4 * (x * u + torch.log1p(-u * u))
        softplus = torch.nn.functional.softplus  # log(p / (p + q)) = log sigmoid(x) = -softplus(-x)
        far = 0.5 * (p * (LOG2 - softplus(-x)) + q * (LOG2 - softplus(x)))
        return torch.where(x.abs() <= 1, near, far)

    def tv_bound(self, delta):
        return _clamp_tv(math.sqrt(2 * delta))

    def full_divergence(self, log_p, log_q):
        # H(m) - (H(p) + H(q)) / 2 with m = (p + q) / 2, as ONE sum of per-cell terms: three sums
        # made the fused pass loop over the vocabulary three times (2.2x the PPO loss time, 1.4x
        # now; benchmarks/loss_speed.md). Zero cells contribute 0 (0 log 0 = 0).
        p, q = log_p.exp(), log_q.exp()
        m = (p + q) / 2
        own = torch.where(p > 0, p * log_p, 0.0) + torch.where(q > 0, q * log_q, 0.0)
        return (own / 2 - torch.where(m > 0, m * m.log(), 0.0)).sum(-1).clamp_(min=0.0)


@dataclass(frozen=True, repr=False)
class AlphaDivergence(Divergence):
    """Alpha family: f(t) = (t^a - 1 - a(t - 1)) / (a(a - 1)); a -> 0 is KL(mu||pi), a -> 1 is
    KL(pi||mu), a = 2 is chi^2 / 2, a = 1/2 is 2 * squared Hellinger."""

    params: ClassVar[tuple[str, ...]] = ("alpha",)

    name: str = "alpha"
    alpha: float = 0.5
    curvature: float = 1.0

    def __post_init__(self):
        a = self.alpha
        if not math.isfinite(a) or a in (0.0, 1.0):
            raise ValueError(
                f"divergence 'alpha' needs alpha finite and not 0 or 1 (got {a}); "
                "use divergence='kl' for alpha -> 0 and 'rkl' for alpha -> 1"
            )
        object.__setattr__(self, "f_tilde_at_0", 1 / a if a > 0 else math.inf)
        object.__setattr__(self, "slope_at_inf", 1 / (1 - a) if a < 1 else math.inf)

    def _interior(self, p, q, log_p, log_q):
        # q f~(t) = q [(t^a - 1) - a (t - 1)] / (a (a - 1)), t = e^x. Swapping p and q maps a to
        # 1 - a (the same cell), so the exponent used is the one nearer 0, b <= 1/2. Near t = 1
        # both brackets are O(x^2) after cancelling O(x) terms: q [(e^(bx) - 1 - bx) - b (e^x - 1 - x)]
        # has none. Farther out, q (t^b - 1) is q expm1(bx) while |bx| <= 1 (so that b -> 0 tends
        # to the KL(mu||pi) cell p - q - q x, not to rounding noise) and q^(1-b) p^b - q beyond.
        b = self.alpha
        if b > 0.5:
            b, p, q, log_p, log_q = 1.0 - b, q, p, log_q, log_p
        x = log_p - log_q
        bx = b * x
        near = q * (expm1_minus(bx) - b * expm1_minus(x))
        q_tb_m1 = torch.where(bx.abs() <= 1, q * torch.expm1(bx), torch.exp(b * log_p + (1 - b) * log_q) - q)
        far = q_tb_m1 - b * (p - q)
        return torch.where(x.abs() <= 1, near, far) / (b * (b - 1))

    def full_divergence(self, log_p, log_q):
        # (sum p^a q^(1-a) - 1) / (a (a - 1)): the subtraction costs eps / |a (a - 1)| in absolute
        # terms, so exponents near 0 or 1 keep the cancellation-free cell sum
        a = self.alpha
        if min(abs(a), abs(1 - a)) < 0.05:
            return super().full_divergence(log_p, log_q)
        mixed = _sum_terms((a * log_p + (1 - a) * log_q).exp_())
        return ((mixed - 1) / (a * (a - 1))).clamp_(min=0.0)

    def tv_bound(self, delta):
        if not -1.0 <= self.alpha <= 2.0:
            raise ValueError(
                f"no TV bound is implemented for alpha={self.alpha}: the bound TV <= sqrt(D/2) "
                "(Gilardoni 2010) holds for alpha in [-1, 2]"
            )
        return _clamp_tv(math.sqrt(delta / 2))

    def __repr__(self) -> str:
        return f"divergence('alpha', alpha={self.alpha})"


DIVERGENCES = Registry("divergence")  # name -> Divergence subclass (its params are its fields)
for _cls in (
    TotalVariation,
    ForwardKL,
    ReverseKL,
    PearsonChi2,
    NeymanChi2,
    SquaredHellinger,
    JensenShannon,
    AlphaDivergence,
):
    DIVERGENCES.add(_cls.name, _cls, builtin=True)


def divergence(name: str, **params) -> Divergence:
    """The divergence called `name`, with its declared parameters (only `alpha`, for 'alpha')."""
    cls = DIVERGENCES.lookup(name)
    unknown = sorted(set(params) - set(cls.params))
    if unknown:
        takes = f"only {list(cls.params)}" if cls.params else "no parameters"
        raise ValueError(f"divergence {name!r} takes {takes} (got {unknown})")
    return cls(**params)
