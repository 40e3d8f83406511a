"""The estimator axis: how D_f(pi || mu) is estimated at each position (DESIGN.md section 3).

`sample` is the single-sample value f~(r) of the sampled token. Every other estimator
coarse-grains the vocabulary into cells and returns the exact D_f between the cell masses of
pi and the anchor, so by the data-processing inequality

    cell <= binary <= topk <= full,    topp <= full.

All estimates are computed without gradient, in float32 (float64 if the inputs are float64).
Each estimator is one `Estimator` in the registry `ESTIMATORS` (what it needs, its parameters, its
ratio interval); `register_estimator` adds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from gppo.core.batch import TokenBatch, require
from gppo.core.divergences import Divergence, log1mexp, upcast
from gppo.core.regions import bisect_interval, cell_interval, sample_interval
from gppo.core.registry import Registry

LOG_RATIO_CLAMP = 20.0  # r = exp(clamp(log p - log q, -20, 20)) (DESIGN.md section 1)
REST_FLOOR = 1e-12  # the rest cell's mass is clamped to at least this
LOG_REST_FLOOR = math.log(REST_FLOOR)


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


def binary_estimate(div: Divergence, logp, logq) -> torch.Tensor:
    """Exact D_f on the partition {sampled token, rest}. A rest mass below REST_FLOOR (e.g. 0 when
    a confident token's log-prob rounds to 0.0) counts as REST_FLOOR, as in the top-K estimator:
    otherwise chi2, rkl or kl would be infinite for a token that merely rounded to probability 1."""
    rest_p, rest_q = (log1mexp(upcast(x)).clamp(min=LOG_REST_FLOOR) for x in (logp, logq))
    return div.cell_terms(logp, logq) + div.cell_terms(rest_p, rest_q)


def nucleus_estimate(div: Divergence, logp, logq, token_ids, topk_ids, topk_logp, topk_logq,
                     top_p: float) -> torch.Tensor:
    """Exact D_f on {mu's nucleus of mass >= top_p within its top-K} u {sampled} u {rest}.

    top_p = 1 gives the top-K estimator. Membership of the sampled token is decided by id.
    """
    if top_p < 1:
        order = topk_logq.argsort(dim=-1, descending=True)
        topk_ids, topk_logp, topk_logq = (x.gather(-1, order) for x in (topk_ids, topk_logp, topk_logq))
        mass = upcast(topk_logq).exp()
        mass_before = torch.cumsum(mass, -1) - mass
        in_nucleus = mass_before < top_p
    else:
        in_nucleus = torch.ones_like(topk_ids, dtype=torch.bool)
    is_sampled = topk_ids == token_ids[..., None]
    own_cell = in_nucleus | is_sampled
    sampled_outside = ~is_sampled.any(-1)

    terms = torch.where(own_cell, div.cell_terms(topk_logp, topk_logq), 0.0).sum(-1)
    terms = terms + torch.where(sampled_outside, div.cell_terms(logp, logq), 0.0)

    def rest_log_mass(top, token):
        mass = torch.where(own_cell, upcast(top).exp(), 0.0).sum(-1)
        mass = mass + torch.where(sampled_outside, upcast(token).exp(), 0.0)
        return torch.log((1.0 - mass).clamp(min=REST_FLOOR))

    return terms + div.cell_terms(rest_log_mass(topk_logp, logp), rest_log_mass(topk_logq, logq))


def full_estimate(div: Divergence, logits, full_logq, mask, chunk_size: int) -> torch.Tensor:
    """Exact D_f over the vocabulary, one chunk of `chunk_size` masked-in tokens at a time."""
    vocab = logits.shape[-1]
    flat_logits, flat_logq = logits.reshape(-1, vocab), full_logq.reshape(-1, vocab)
    positions = mask.reshape(-1).bool().nonzero().squeeze(-1)
    out = torch.zeros(mask.numel(), dtype=upcast(logits[:0]).dtype, device=logits.device)
    for chunk in positions.split(chunk_size):  # only one [chunk, V] slice exists at a time
        log_pi = torch.log_softmax(upcast(flat_logits.index_select(0, chunk)), dim=-1)
        out[chunk] = div.between_log(log_pi, flat_logq.index_select(0, chunk)).to(out.dtype)
    return out.view(mask.shape)


@dataclass(frozen=True)
class Estimator:
    """An estimator: what it needs, its parameters, its ratio interval, how it computes.

    compute(div, batch, anchor, config) -> D-hat [B,T]. `needs`: TokenBatch fields beyond the anchor;
    `anchor`: which anchor log-probs it reads ("token", "topk", "full"); `params`: the GPPOConfig
    fields it reads. `token_estimate(div, logp, logq)` is set when the estimate is a function of the
    sampled token's log-probs alone: its region is then a ratio interval (clip-style rules, theory),
    computed by `interval(div, q, delta_low, delta_high)` when a closed form is given, by
    `constant_interval(div, delta_low, delta_high)` when it does not depend on q, else by bisection.
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
        return bisect_interval(lambda logp, logq: self.token_estimate(div, logp, logq), q,
                               delta_low, delta_high)


def _per_token(fn: Callable) -> Callable:
    def compute(div, batch, anchor, config):
        return fn(div, batch.logp, anchor.logq)
    return compute


def _topk(top_p_of: Callable):
    def compute(div, batch, anchor, config):
        return nucleus_estimate(div, batch.logp, anchor.logq, batch.token_ids, batch.topk_ids,
                                batch.topk_logp, anchor.topk_logq, top_p_of(config))
    return compute


ESTIMATORS = Registry("estimator")
for _est in (
    Estimator("sample", _per_token(sample_estimate), summary="single-sample f~(r) of the sampled token",
              token_estimate=sample_estimate, constant_interval=sample_interval),
    Estimator("cell", _per_token(cell_estimate), summary="the sampled token's own cell q f~(r)",
              token_estimate=cell_estimate, interval=cell_interval),
    Estimator("binary", _per_token(binary_estimate), summary="exact D_f on {sampled, rest}",
              token_estimate=binary_estimate),
    Estimator("topk", _topk(lambda c: 1.0), ("token_ids", "topk_ids", "topk_logp"), ("token", "topk"),
              ("top_k",), "exact D_f on mu's top-K u {sampled} u {rest}"),
    Estimator("topp", _topk(lambda c: c.top_p), ("token_ids", "topk_ids", "topk_logp"), ("token", "topk"),
              ("top_k", "top_p"), "exact D_f on mu's nucleus (mass top_p, at most K) u {sampled} u {rest}"),
    Estimator("full", lambda div, batch, anchor, config: full_estimate(
                  div, batch.logits, anchor.full_logq, batch.mask, config.full_chunk_size),
              ("logits",), ("full",), (), "exact D_f over the whole vocabulary"),
):
    ESTIMATORS.add(_est.name, _est, builtin=True)


def register_estimator(name: str, *, needs=(), anchor=("token",), params=(), per_token: bool = False,
                       summary: str = ""):
    """Decorator registering an estimator under `name`.

    Default form: fn(div, batch, anchor, config) -> D-hat [B,T] (div a gppo.Divergence, anchor the
    centre's log-probs: .logq [B,T], .topk_logq, .full_logq), reading the TokenBatch fields `needs`,
    the anchor roles `anchor` ("token", "topk", "full") and the GPPOConfig fields `params`.
    per_token=True: fn(div, logp, logq) -> D-hat of the sampled token from its log-probs alone; its
    trust region is then a ratio interval (rules clip and geo-mean accept it, gppo.theory plots it).
    """
    from gppo.core.config import check_params  # config imports this module

    ESTIMATORS.check_new(name)
    batch_fields = {f.name for f in fields(TokenBatch)}
    unknown = [n for n in needs if n not in batch_fields]
    if unknown:
        raise ValueError(f"estimator {name!r} needs {unknown}, which are not TokenBatch fields "
                         f"{sorted(batch_fields)}")
    bad_roles = [r for r in anchor if r not in ANCHOR_ROLES]
    if bad_roles or not anchor:
        raise ValueError(f"estimator {name!r}: anchor must name some of {list(ANCHOR_ROLES)} "
                         f"(got {list(anchor)})")
    check_params(f"estimator {name!r}", params)
    if "topk_ids" in needs and "top_k" not in params:
        raise ValueError(f"estimator {name!r} needs mu's top-K (topk_ids), so it must declare top_k "
                         "among its params: top_k is how many entries the rollout records")

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"register_estimator({name!r}) decorates a function, got {type(fn).__name__}")
        compute, token = (_per_token(fn), fn) if per_token else (fn, None)
        ESTIMATORS.add(name, Estimator(name, compute, tuple(needs), tuple(anchor), tuple(params),
                                       summary or (fn.__doc__ or "").strip().split("\n")[0],
                                       token_estimate=token))
        return fn
    return decorate


def run_estimator(config, batch: TokenBatch, div: Divergence | None = None) -> torch.Tensor:
    """D-hat [B,T] for `config.estimator` (0 at masked-out positions), without gradient; float32,
    or float64 when the inputs are."""
    est = ESTIMATORS.lookup(config.estimator)
    require(batch, est.batch_fields(config.anchor),
            f"estimator {config.estimator!r} with anchor={config.anchor!r}")
    anchor = anchor_of(batch, config.anchor)
    with torch.no_grad():
        value = est.compute(div or config.divergence_fn, batch, anchor, config)
        return torch.where(batch.token_mask, upcast(value), 0.0)
