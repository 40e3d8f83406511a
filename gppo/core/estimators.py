"""The estimator axis: how D_f(pi || mu) is estimated at each position (docs/design.md section 3).

`sample` is the single-sample value f~(r) of the sampled token. Every other estimator
coarse-grains the vocabulary into cells and returns the exact D_f between the cell masses of
pi and the anchor, so by the data-processing inequality

    cell <= binary <= topk <= full,    topp <= full.

All estimates are computed without gradient, in float32 (float64 if the inputs are float64).
Each estimator is one `Estimator` in the registry `ESTIMATORS` (what it needs, its parameters, its
ratio interval); `register_estimator` adds one.

The rest cell (everything outside the explicit cells) has the mass 1 - sum of the cells, taken in
log space (`rest_log_mass`). Below the resolution of the inputs (their dtype's eps: 1.2e-7 for
float32, 7.8e-3 for bfloat16) a rest mass is not known, only that it is tiny, so both rests, pi's
and the anchor's, are raised to that same floor (`rest_floor`). Raising both masses of one cell to
a common floor moves them towards each other, and a cell term q f~(p/q) only shrinks when p and q
approach each other (it is convex in each with its minimum 0 at p = q): the floored estimate stays
below the exact one, so the data-processing order above holds in float32, and two rests below
the floor contribute 0 rather than rounding noise against a floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from gppo.core.batch import TokenBatch, require
from gppo.core.divergences import Divergence
from gppo.core.numerics import log1mexp, upcast
from gppo.core.params import check_params
from gppo.core.regions import bisect_interval, cell_interval, sample_interval
from gppo.core.registry import Registry
from gppo.core.token_stats import logits_stats

LOG_RATIO_CLAMP = 20.0  # r = exp(clamp(log p - log q, -20, 20)) (docs/design.md section 1)


@dataclass(frozen=True)
class Anchor:
    """The trust-region centre's log-probs: of the sampled token, at mu's top-K ids, full."""

    logq: torch.Tensor
    topk_logq: torch.Tensor | None
    full_logq: torch.Tensor | None


ANCHOR_ROLES = ("token", "topk", "full")  # the Anchor fields, in order
ANCHOR_FIELDS = {
    "behavior": ("logp_behavior", "topk_logp_behavior", "logp_behavior_full"),
    "old": ("logp_old", "topk_logp_old", "logp_old_full"),
}


def anchor_of(batch: TokenBatch, anchor: str) -> Anchor:
    token, topk, full = ANCHOR_FIELDS[anchor]
    require(batch, [token], f"anchor={anchor!r}")
    return Anchor(getattr(batch, token), getattr(batch, topk), getattr(batch, full))


def sample_estimate(div: Divergence, logp, logq) -> torch.Tensor:
    """f~(r): the single-sample Monte Carlo estimate of D_f (unbiased in expectation, not a bound)."""
    log_ratio = (logp - logq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return div.f_normalized(log_ratio.exp())


def cell_estimate(div: Divergence, logp, logq) -> torch.Tensor:
    """q f~(p/q): the sampled token's own cell (RIPO's geometry with chi^2)."""
    return div.cell_terms(logp, logq)


def rest_floor(*inputs: torch.Tensor) -> float:
    """log of the common floor of the rest masses: the eps of the least precise input dtype."""
    return math.log(max(torch.finfo(x.dtype).eps for x in inputs))


def rest_log_mass(log_masses: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_j exp(l_j)) over the last axis (-inf entries are empty), accurate when the
    rest is tiny: log sum_j exp(l_j) = m + log1p(sum_{j != argmax} exp(l_j - m)), then log1mexp.
    (The plain 1 - sum in float32 is rounding noise below 6e-8.) -inf when the cells cover 1."""
    top, where = log_masses.max(-1, keepdim=True)
    top_safe = torch.where(torch.isfinite(top), top, 0.0)
    others = (log_masses - top_safe).exp().scatter(-1, where, 0.0).sum(-1)
    covered = top.squeeze(-1) + torch.log1p(others)
    return log1mexp(covered.clamp(max=0.0))


def binary_estimate(div: Divergence, logp, logq) -> torch.Tensor:
    """Exact D_f on the partition {sampled token, rest}, the rests floored as in `rest_floor` (a
    confident token whose log-prob rounds to 0.0 leaves a rest of 0, which would make chi2, rkl
    or kl infinite)."""
    floor = rest_floor(logp, logq)
    rest_p, rest_q = (log1mexp(upcast(x)).clamp(min=floor) for x in (logp, logq))
    return div.cell_terms(logp, logq) + div.cell_terms(rest_p, rest_q)


def nucleus_estimate(
    div: Divergence, logp, logq, token_ids, topk_ids, topk_logp, topk_logq, top_p: float, top_k: int | None = None
) -> torch.Tensor:
    """Exact D_f on {mu's nucleus of mass >= top_p within its top-K} u {sampled} u {rest}.

    top_p = 1 gives the top-K estimator. Entries whose id repeats an earlier one (engines return
    the top-K plus the sampled token, which may be one of them) are merged into it; at most
    `top_k` distinct entries are used, those of largest anchor mass. Membership of the sampled
    token is decided by id.
    """
    floor = rest_floor(logp, logq, topk_logp, topk_logq)
    duplicate = (topk_ids[..., :, None] == topk_ids[..., None, :]).tril(-1).any(-1)
    topk_logp, topk_logq = upcast(topk_logp), upcast(topk_logq)
    key = topk_logq.masked_fill(duplicate, -math.inf)
    order = key.argsort(dim=-1, descending=True, stable=True)  # distinct entries first, by mass
    topk_ids, topk_logp, topk_logq, duplicate = (
        x.gather(-1, order) for x in (topk_ids, topk_logp, topk_logq, duplicate)
    )
    used = ~duplicate
    if top_k is not None:
        used = used & (torch.arange(used.shape[-1], device=used.device) < top_k)
    if top_p < 1:
        mass = torch.where(used, topk_logq.exp(), 0.0)
        used = used & (torch.cumsum(mass, -1) - mass < top_p)
    is_sampled = ~duplicate & (topk_ids == token_ids[..., None])
    own_cell = used | is_sampled
    sampled_outside = ~is_sampled.any(-1)

    terms = torch.where(own_cell, div.cell_terms(topk_logp, topk_logq), 0.0).sum(-1)
    terms = terms + torch.where(sampled_outside, div.cell_terms(logp, logq), 0.0)

    def cell_log_masses(top, token):  # [..., K + 1]: the explicit cells, -inf where none
        return torch.cat(
            [torch.where(own_cell, top, -math.inf), torch.where(sampled_outside, upcast(token), -math.inf)[..., None]],
            -1,
        )

    rest_p, rest_q = (
        rest_log_mass(cell_log_masses(top, token)).clamp(min=floor)
        for top, token in ((topk_logp, logp), (topk_logq, logq))
    )
    return terms + div.cell_terms(rest_p, rest_q)


def full_estimate(div: Divergence, logits, full_logq, mask, chunk_size: int | None = None) -> torch.Tensor:
    """Exact D_f over the vocabulary (`Divergence.full_divergence`: a closed form for the
    built-ins) at the masked-in tokens [B,T], both distributions normalised, by the vocabulary
    kernel (`gppo.core.token_stats`), `chunk_size` tokens at a time (default: about 2**24 logits)."""
    stats = logits_stats(logits, mask=mask, anchor_log_probs=full_logq, divergence=div, chunk_size=chunk_size)
    return stats.full_estimate


@dataclass(frozen=True)
class Estimator:
    """An estimator: what it needs, its parameters, its ratio interval, how it computes.

    compute(div, batch, anchor, config) -> D-hat [B,T]. `needs`: TokenBatch fields beyond the anchor;
    `anchor`: which anchor log-probs it reads ("token", "topk", "full"); `params`: the GPPOConfig
    fields it reads. `token_estimate(div, logp, logq)` is set when the estimate is a function of the
    sampled token's log-probs alone: its region is then a ratio interval (clip-style rules, theory),
    computed by `interval(div, q, delta_low, delta_high)` when a closed form is given, by
    `constant_interval(div, delta_low, delta_high)` when it does not depend on q, else by bisection.
    `precomputed`: a TokenBatch field holding the estimate computed by the caller (the full
    estimator's vocabulary sum, done chunk by chunk from hidden states): used instead of `compute`.
    """

    name: str
    compute: Callable
    needs: tuple[str, ...] = ()
    anchor: tuple[str, ...] = ("token",)
    params: tuple[str, ...] = ()
    summary: str = ""
    token_estimate: Callable | None = None
    interval: Callable | None = None
    constant_interval: Callable | None = None
    precomputed: str | None = None  # a TokenBatch field that, when given, is the estimate itself

    @property
    def needs_rollout_topk(self) -> bool:
        """Whether the rollout must record mu's top-K ids (and log-probs) for this estimator."""
        return "topk_ids" in self.needs

    @property
    def has_ratio_interval(self) -> bool:
        return self.token_estimate is not None

    def batch_fields(self, anchor: str) -> list[str]:
        """Every TokenBatch field this estimator reads with the given anchor ('behavior' / 'old')."""
        anchor_fields = dict(zip(ANCHOR_ROLES, ANCHOR_FIELDS[anchor]))
        return [*self.needs, *(anchor_fields[role] for role in self.anchor)]

    def ratio_interval(self, div: Divergence, q, delta_low, delta_high):
        """Per-token [lo, hi] of r = p/q within the radii for anchor probability q (float64, any
        shape); hi never exceeds 1/q (p <= 1)."""
        if self.token_estimate is None:
            raise ValueError(
                f"estimator {self.name!r} has no ratio interval: its estimate depends on other tokens' "
                "probabilities, not only on the sampled token's p and q"
            )
        q = torch.as_tensor(q, dtype=torch.float64)
        if self.constant_interval is not None:
            lo, hi = self.constant_interval(div, float(delta_low), float(delta_high))
            return torch.full_like(q, lo), torch.full_like(q, hi).minimum(1.0 / q)
        if self.interval is not None:
            lo, hi = self.interval(div, q, delta_low, delta_high)
            return lo, hi.minimum(1.0 / q)
        return bisect_interval(lambda logp, logq: self.token_estimate(div, logp, logq), q, delta_low, delta_high)


def _per_token(fn: Callable) -> Callable:
    def compute(div, batch, anchor, config):
        return fn(div, batch.logp, anchor.logq)

    return compute


def _topk(top_p_of: Callable):
    def compute(div, batch, anchor, config):
        return nucleus_estimate(
            div,
            batch.logp,
            anchor.logq,
            batch.token_ids,
            batch.topk_ids,
            batch.topk_logp,
            anchor.topk_logq,
            top_p_of(config),
            config.top_k,
        )

    return compute


ESTIMATORS = Registry("estimator")
for _est in (
    Estimator(
        "sample",
        _per_token(sample_estimate),
        summary="single-sample f~(r) of the sampled token",
        token_estimate=sample_estimate,
        constant_interval=sample_interval,
    ),
    Estimator(
        "cell",
        _per_token(cell_estimate),
        summary="the sampled token's own cell q f~(r)",
        token_estimate=cell_estimate,
        interval=cell_interval,
    ),
    Estimator(
        "binary", _per_token(binary_estimate), summary="exact D_f on {sampled, rest}", token_estimate=binary_estimate
    ),
    Estimator(
        "topk",
        _topk(lambda c: 1.0),
        ("token_ids", "topk_ids", "topk_logp"),
        ("token", "topk"),
        ("top_k",),
        "exact D_f on mu's top-K u {sampled} u {rest}",
    ),
    Estimator(
        "topp",
        _topk(lambda c: c.top_p),
        ("token_ids", "topk_ids", "topk_logp"),
        ("token", "topk"),
        ("top_k", "top_p"),
        "exact D_f on mu's nucleus (mass top_p, at most K) u {sampled} u {rest}",
    ),
    Estimator(
        "full",
        lambda div, batch, anchor, config: full_estimate(div, batch.logits, anchor.full_logq, batch.mask),
        ("logits",),
        ("full",),
        (),
        "exact D_f over the whole vocabulary",
        precomputed="full_estimate",
    ),
):
    ESTIMATORS.add(_est.name, _est, builtin=True)


def register_estimator(
    name: str, *, needs=(), anchor=("token",), params=(), per_token: bool = False, summary: str = ""
):
    """Decorator registering an estimator under `name`.

    Default form: fn(div, batch, anchor, config) -> D-hat [B,T] (div a gppo.Divergence, anchor the
    centre's log-probs: .logq [B,T], .topk_logq, .full_logq), reading the TokenBatch fields `needs`,
    the anchor roles `anchor` ("token", "topk", "full") and the GPPOConfig fields `params`.
    per_token=True: fn(div, logp, logq) -> D-hat of the sampled token from its log-probs alone; its
    trust region is then a ratio interval (rules clip and geo-mean accept it, gppo.theory plots it).
    """
    ESTIMATORS.check_new(name)
    batch_fields = {f.name for f in fields(TokenBatch)}
    unknown = [n for n in needs if n not in batch_fields]
    if unknown:
        raise ValueError(f"estimator {name!r} needs {unknown}, which are not TokenBatch fields {sorted(batch_fields)}")
    bad_roles = [r for r in anchor if r not in ANCHOR_ROLES]
    if bad_roles or not anchor:
        raise ValueError(f"estimator {name!r}: anchor must name some of {list(ANCHOR_ROLES)} (got {list(anchor)})")
    check_params(f"estimator {name!r}", params)
    if "topk_ids" in needs and "top_k" not in params:
        raise ValueError(
            f"estimator {name!r} needs mu's top-K (topk_ids), so it must declare top_k "
            "among its params: top_k is how many entries the rollout records"
        )

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"register_estimator({name!r}) decorates a function, got {type(fn).__name__}")
        compute, token = (_per_token(fn), fn) if per_token else (fn, None)
        ESTIMATORS.add(
            name,
            Estimator(
                name,
                compute,
                tuple(needs),
                tuple(anchor),
                tuple(params),
                summary or (fn.__doc__ or "").strip().split("\n")[0],
                token_estimate=token,
            ),
        )
        return fn

    return decorate


def run_estimator(config, batch: TokenBatch, div: Divergence | None = None) -> torch.Tensor:
    """D-hat [B,T] for `config.estimator` (0 at masked-out positions), without gradient; float32,
    or float64 when the inputs are."""
    est = ESTIMATORS.lookup(config.estimator)
    given = getattr(batch, est.precomputed) if est.precomputed is not None else None
    with torch.no_grad():
        if given is not None:
            return torch.where(batch.token_mask, upcast(given.detach()), 0.0)
        require(
            batch,
            est.batch_fields(config.anchor),
            f"estimator {config.estimator!r} with anchor={config.anchor!r}"
            + (f" (or TokenBatch.{est.precomputed})" if est.precomputed else ""),
        )
        value = est.compute(div or config.divergence_fn, batch, anchor_of(batch, config.anchor), config)
        return torch.where(batch.token_mask, upcast(value), 0.0)
