"""The estimator axis: how D_f(pi || mu) is estimated at each position (DESIGN.md section 3).

`sample` is the single-sample value f~(r) of the sampled token. Every other estimator
coarse-grains the vocabulary into cells and returns the exact D_f between the cell masses of
pi and the anchor, so by the data-processing inequality

    cell <= binary <= topk <= full,    topp <= full.

All estimates are computed without gradient, in float32 (float64 if the inputs are float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from gppo.core.batch import TokenBatch, require
from gppo.core.divergences import Divergence, log1mexp, upcast

LOG_RATIO_CLAMP = 20.0  # r = exp(clamp(log p - log q, -20, 20)) (DESIGN.md section 1)
REST_FLOOR = 1e-12  # the rest cell's mass is clamped to at least this
LOG_REST_FLOOR = math.log(REST_FLOOR)


@dataclass(frozen=True)
class Anchor:
    """The trust-region centre's log-probs: of the sampled token, at mu's top-K ids, full."""

    logq: torch.Tensor
    topk_logq: torch.Tensor | None
    full_logq: torch.Tensor | None


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
    """An estimator: the TokenBatch fields it needs (beyond the anchor) and how it computes."""

    name: str
    needs: tuple[str, ...]
    needs_anchor: tuple[int, ...]  # which Anchor fields: 0 token, 1 top-K, 2 full
    summary: str
    compute: Callable


def _topk(top_p_of: Callable):
    def compute(div, batch, anchor, config):
        return nucleus_estimate(div, batch.logp, anchor.logq, batch.token_ids, batch.topk_ids,
                                batch.topk_logp, anchor.topk_logq, top_p_of(config))
    return compute


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("sample", (), (0,), "single-sample f~(r) of the sampled token",
                  lambda div, batch, anchor, config: sample_estimate(div, batch.logp, anchor.logq)),
        Estimator("cell", (), (0,), "the sampled token's own cell q f~(r)",
                  lambda div, batch, anchor, config: cell_estimate(div, batch.logp, anchor.logq)),
        Estimator("binary", (), (0,), "exact D_f on {sampled, rest}",
                  lambda div, batch, anchor, config: binary_estimate(div, batch.logp, anchor.logq)),
        Estimator("topk", ("token_ids", "topk_ids", "topk_logp"), (0, 1),
                  "exact D_f on mu's top-K u {sampled} u {rest}", _topk(lambda c: 1.0)),
        Estimator("topp", ("token_ids", "topk_ids", "topk_logp"), (0, 1),
                  "exact D_f on mu's nucleus (mass top_p, at most K) u {sampled} u {rest}",
                  _topk(lambda c: c.top_p)),
        Estimator("full", ("logits",), (2,), "exact D_f over the whole vocabulary",
                  lambda div, batch, anchor, config: full_estimate(
                      div, batch.logits, anchor.full_logq, batch.mask, config.full_chunk_size)),
    )
}


def run_estimator(config, batch: TokenBatch, div: Divergence | None = None) -> torch.Tensor:
    """D-hat [B,T] for `config.estimator` (0 at masked-out positions), without gradient; float32,
    or float64 when the inputs are."""
    est = ESTIMATORS[config.estimator]
    token, topk, full = ANCHOR_FIELDS[config.anchor]
    anchor_names = [(token, topk, full)[i] for i in est.needs_anchor]
    require(batch, [*est.needs, *anchor_names],
            f"estimator {config.estimator!r} with anchor={config.anchor!r}")
    anchor = anchor_of(batch, config.anchor)
    with torch.no_grad():
        value = est.compute(div or config.divergence_fn, batch, anchor, config)
        return torch.where(batch.token_mask, upcast(value), 0.0)
