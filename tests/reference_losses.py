"""Independent references for the presets added from verl, TRL, prime-rl and IcePop: each written
from the method's equation (plain torch, per-sequence loops where the method works per sequence),
sharing no code with gppo.core. Shapes [B,T]; `adv` is [B] (one advantage per sequence); `mask`
is 0/1; the loss is token-mean unless the name says otherwise."""

from __future__ import annotations

import math

import torch


def token_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def gpg_loss(logp, adv, mask):
    """GPG (2504.02546) as verl's gpg mode: -A log pi."""
    return token_mean(-adv[:, None] * logp, mask)


def dro_loss(logp, logq, adv, mask, beta):
    """DRO (2405.19107): -(log pi A - beta/2 (log pi/mu)^2)."""
    return token_mean(-(logp * adv[:, None] - 0.5 * beta * (logp - logq) ** 2), mask)


def _covariances(logp, adv, mask):
    """(position, cov) for every response token: cov = (A - mean A)(log pi - mean log pi), the means
    over the batch's response tokens."""
    positions = [(i, t) for i in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[i, t]]
    a = torch.stack([adv[i] for i, _ in positions])
    lp = torch.stack([logp[i, t].detach() for i, t in positions])
    return positions, (a - a.mean()) * (lp - lp.mean())


def kl_cov_loss(logp, logq, adv, mask, ratio, coef):
    """KL-Cov (2505.22617): -A r on every token, plus coef |log r| on the floor(ratio N) tokens
    (at least one) of largest covariance."""
    positions, cov = _covariances(logp, adv, mask)
    count = max(1, math.floor(ratio * len(positions)))
    chosen = {positions[j] for j in sorted(range(len(cov)), key=lambda j: -cov[j].item())[:count]}
    log_r = logp - logq
    penalty = torch.zeros_like(logp)
    for i, t in chosen:
        penalty[i, t] = 1.0
    return token_mean(-adv[:, None] * log_r.exp() + coef * log_r.abs() * penalty, mask)


def clip_cov_loss(logp, logq, adv, mask, eps, ratio, low, high, seed):
    """Clip-Cov (2505.22617): PPO's clip; among the unclipped tokens whose covariance lies in
    (low, high), floor(ratio N) (at least one) drawn by a random permutation under torch seed
    `seed` lose their loss. The draw is verl's (torch.randperm over the candidates in row order)."""
    positions, cov = _covariances(logp, adv, mask)
    r = (logp - logq).exp()
    a = adv[:, None].expand_as(r)
    surrogate = torch.min(r * a, r.clamp(1 - eps, 1 + eps) * a)
    clipped = ((a > 0) & (r > 1 + eps)) | ((a < 0) & (r < 1 - eps))
    candidates = [p for p, c in zip(positions, cov) if low < c.item() < high and not clipped[p]]
    keep = torch.ones_like(logp)
    if candidates:
        torch.manual_seed(seed)
        order = torch.randperm(len(candidates)).tolist()
        for j in order[: max(1, math.floor(ratio * len(positions)))]:
            keep[candidates[j]] = 0.0
    return token_mean(-surrogate * keep, mask), keep


def vespo_loss(logp, logq, adv, mask, k_pos, lam_pos, k_neg, lam_neg):
    """VESPO (2602.10693): -sg[phi(w)] A log pi, w = prod_t pi/mu over the sequence,
    phi(w) = w^k exp(-lambda (w - 1)), (k, lambda) by the sign of A (A >= 0: the positive pair)."""
    rows = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        w = torch.prod(torch.exp(logp[i, :n].detach() - logq[i, :n]))
        k, lam = (k_pos, lam_pos) if adv[i] >= 0 else (k_neg, lam_neg)
        phi = w**k * torch.exp(-lam * (w - 1))
        rows.append(-phi * adv[i] * logp[i])
    return token_mean(torch.stack(rows), mask)


def prime_dppo_kl_loss(logp, logq, adv, mask, low, high, tau):
    """prime-rl's default loss: mask tokens with A > 0 and pi - mu > high or A < 0 and
    pi - mu < -low; -A r on the others, plus tau (log r)^2 on every token."""
    diff = logp.exp() - logq.exp()
    a = adv[:, None].expand_as(logp)
    masked = ((a > 0) & (diff > high)) | ((a < 0) & (diff < -low))
    log_r = logp - logq
    return token_mean(-a * log_r.exp() * (~masked) + tau * log_r**2, mask)


def icepop_loss(logp, logq, adv, mask, alpha, beta):
    """IcePop, two-policy reading: weight r = pi/mu kept where alpha <= r <= beta, else 0;
    -sg[weight] A log pi."""
    r = (logp - logq).exp().detach()
    weight = torch.where((r >= alpha) & (r <= beta), r, torch.zeros_like(r))
    return token_mean(-weight * adv[:, None] * logp, mask)


def dr_grpo_loss(logp, logq, adv, mask, eps, length):
    """Dr. GRPO (2503.20783): PPO's clip summed over every token, divided by B x a constant length."""
    r = (logp - logq).exp()
    a = adv[:, None]
    surrogate = torch.min(r * a, r.clamp(1 - eps, 1 + eps) * a)
    return -(surrogate * mask).sum() / (logp.shape[0] * length)


def luspo_loss(logp, logq, adv, mask, eps_low, eps_high):
    """LUSPO (2602.05261): GSPO's clipped sequence objective times the sequence length,
    -mean_i |y_i| min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it)."""
    lengths = mask.sum(-1)
    s = torch.exp(((logp - logq) * mask).sum(-1) / lengths)
    return -(lengths * torch.min(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)).mean()


def opsm_grpo_loss(logp, logq, adv, mask, eps, threshold):
    """GRPO's clip with DeepSeek-V3.2's off-policy sequence mask (2512.02556, Eq. 9): a sequence
    with A < 0 whose mean over its tokens of log mu - log pi exceeds the threshold is dropped;
    mean over each sequence's tokens, then over sequences."""
    losses = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        lp, lq = logp[i, :n], logq[i, :n]
        r = (lp - lq).exp()
        surrogate = torch.min(r * adv[i], r.clamp(1 - eps, 1 + eps) * adv[i])
        drift = (lq - lp.detach()).mean()
        keep = 0.0 if (adv[i] < 0 and drift > threshold) else 1.0
        losses.append(-keep * surrogate.mean())
    return torch.stack(losses).mean()
