"""The row formulas over the vocabulary, stated once: [rows, V] in, one value per row out.

Every vocabulary-wide quantity gppo computes goes through these (`gppo.token_stats` from hidden
states or from logits, the HF engine's sampling distribution). Inputs are log-distributions in
float32 or float64; a zero-probability entry (log pi = -inf or finfo.min) contributes 0.

    log_normalize_(z)       log pi = z - log sum_v exp z_v
    entropy(log_pi, pi)     H = -sum_v pi_v log pi_v (cells: plogp)
    kl_cells(...)           pi_v (log pi_v - log ref_v), summed: KL(pi || ref)
    exact_divergence(...)   D_f(pi || mu) = sum_v mu_v f(pi_v / mu_v), the divergence's closed form
"""

from __future__ import annotations

import torch

from gppo.core.divergences import Divergence


def log_normalize_(x: torch.Tensor) -> torch.Tensor:
    """x - log sum exp(x) over the last axis, in place, as (x - max) - log sum exp(x - max).

    Used instead of torch.log_softmax, whose float32 normaliser on CPU is off by ~1e-5 at
    V = 50k (summed less accurately), and of torch.logsumexp, which is ~100x slower on CPU.
    A row that is all -inf becomes NaN (no distribution)."""
    x -= x.amax(-1, keepdim=True)
    x -= x.exp().sum(-1, keepdim=True).log_()
    return x


def plogp(log_pi: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """pi log pi per entry (pi = exp(log_pi)), 0 where pi = 0: the entropy's cells."""
    return torch.where(pi > 0, pi * log_pi, 0.0)


def entropy(log_pi: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """-sum_v pi_v log pi_v per row."""
    return -plogp(log_pi, pi).sum(-1)


def kl_cells(log_pi: torch.Tensor, pi: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """pi (log pi - log ref): the KL(pi || ref) cells, 0 where pi = 0 (a masked column, where
    log ref may be -inf); log ref is read in log pi's dtype."""
    return pi * torch.where(pi > 0, log_pi - log_ref.to(log_pi.dtype), 0.0)


def exact_divergence(divergence: Divergence, log_pi: torch.Tensor, anchor_log_probs: torch.Tensor) -> torch.Tensor:
    """D_f(pi || mu) per row, `Divergence.full_divergence` (a closed form for the built-ins), with
    mu's row normalised in log pi's dtype: the closed forms use sum mu = 1, and recorded log-probs
    sum to 1 only up to their rounding (0.5 % in bfloat16). The anchor is copied, not changed."""
    log_mu = log_normalize_(anchor_log_probs.to(log_pi.dtype, copy=True))
    return divergence.full_divergence(log_pi, log_mu)
