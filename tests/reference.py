"""Independent references for the core tests: the formulas of docs/design.md and the method papers,
written directly (pure Python / plain torch ops), sharing no code with gppo.core."""

from __future__ import annotations

import math

import torch


def generator(name: str, alpha: float = 0.5):
    """The raw generator f(t) of docs/design.md section 2 (not normalised), with f(0) as a limit."""

    def f(t: float) -> float:
        if name == "tv":
            return 0.5 * abs(t - 1)
        if name == "kl":
            return math.inf if t == 0 else -math.log(t)
        if name == "rkl":
            return 0.0 if t == 0 else t * math.log(t)
        if name == "chi2":
            return (t - 1) ** 2
        if name == "neyman":
            return math.inf if t == 0 else (t - 1) ** 2 / t
        if name == "hellinger":
            return (math.sqrt(t) - 1) ** 2
        if name == "js":
            if t == 0:
                return 0.5 * math.log(2)
            return 0.5 * (t * math.log(2 * t / (1 + t)) + math.log(2 / (1 + t)))
        if name == "alpha":
            a = alpha
            if t == 0:
                return math.inf if a < 0 else (-1 + a) / (a * (a - 1))
            return (t**a - 1 - a * (t - 1)) / (a * (a - 1))
        raise KeyError(name)

    return f


def slope_at_infinity(name: str, alpha: float = 0.5) -> float:
    """lim_{t->inf} f(t)/t of the raw generator (the q = 0 < p cell is p times this)."""
    return {
        "tv": 0.5,
        "kl": 0.0,
        "rkl": math.inf,
        "chi2": math.inf,
        "neyman": 1.0,
        "hellinger": 1.0,
        "js": 0.5 * math.log(2),
        "alpha": 1 / (1 - alpha) if alpha < 1 else math.inf,
    }[name]


def brute_force_divergence(name: str, p, q, alpha: float = 0.5) -> float:
    """sum_a q f(p/q) with the conventions 0 f(0/0) = 0 and 0 f(p/0) = p lim f(t)/t."""
    f = generator(name, alpha)
    total = 0.0
    for pi, qi in zip(map(float, p), map(float, q)):
        if qi > 0:
            total += qi * f(pi / qi)
        elif pi > 0:
            total += pi * slope_at_infinity(name, alpha)
    return total


def partition_divergence(name, pi, mu, cells, alpha: float = 0.5) -> float:
    """Exact D_f between the cell masses of pi and mu; `cells` lists disjoint index sets, the
    remaining indices form one more 'rest' cell."""
    used = set().union(*cells) if cells else set()
    rest = [i for i in range(len(pi)) if i not in used]
    masses_p = [sum(float(pi[i]) for i in c) for c in cells] + [sum(float(pi[i]) for i in rest)]
    masses_q = [sum(float(mu[i]) for i in c) for c in cells] + [sum(float(mu[i]) for i in rest)]
    return brute_force_divergence(name, masses_p, masses_q, alpha)


def ppo_clip_loss(logp, logq, adv, mask, eps_low, eps_high, dual_clip=None):
    """PPO (Schulman et al. 2017), token-mean; dual clip (Ye et al. 2020) for A < 0."""
    r = torch.exp(logp - logq)
    adv = adv[:, None].expand_as(r) if adv.dim() == 1 else adv
    surrogate = torch.min(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip * adv), surrogate)
    return -(surrogate * mask).sum() / mask.sum()


def decoupled_ppo_loss(logp, logp_old, logq, adv, mask, eps, cap):
    """PPO's clip around a recomputed pi_old, times the truncated weight sg[min(pi_old / mu, C)]
    (MiniRL, Zheng et al. 2025), token-mean."""
    r = torch.exp(logp - logp_old)
    weight = torch.exp(logp_old - logq).clamp(max=cap)
    surrogate = torch.min(r * adv[:, None], torch.clamp(r, 1 - eps, 1 + eps) * adv[:, None]) * weight
    return -(surrogate * mask).sum() / mask.sum()


def binary_tv(p, q):
    return (p - q).abs()


def binary_kl(p, q):
    """KL(mu || pi) on {a, rest}: q log(q/p) + (1-q) log((1-q)/(1-p)) (docs/design.md section 3)."""
    return q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))


def dppo_loss(logp, logq, adv, mask, divergence_value, delta_low, delta_high, cap=None):
    """DPPO Eq. 12: M = 0 if (A>0, p>q, D>delta_high) or (A<0, p<q, D>delta_low);
    loss -A sg[min(r, C)] log p M, or -A r M when C = inf; token-mean."""
    r = torch.exp(logp - logq)
    adv = adv[:, None].expand_as(r) if adv.dim() == 1 else adv
    p, q = logp.exp(), logq.exp()
    outside = ((adv > 0) & (p > q) & (divergence_value > delta_high)) | (
        (adv < 0) & (p < q) & (divergence_value > delta_low)
    )
    keep = (~outside).float()
    weight = r if cap is None else torch.clamp(r.detach(), max=cap) * logp
    return -(adv * weight * keep * mask).sum() / mask.sum()


def seq_mean_token_mean(values, mask):
    return ((values * mask).sum(-1) / mask.sum(-1)).mean()


def gspo_loss(logp, logq, adv, mask, eps_low, eps_high):
    """GSPO (2507.18071): s_i = exp(mean_t log r_it); -mean_i min(s_i A_i, clip(s_i) A_i)."""
    s = torch.exp(((logp - logq) * mask).sum(-1) / mask.sum(-1))
    return -torch.min(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv).mean()


def gmpo_loss(logp, logq, adv, mask, eps):
    """GMPO (2507.20673): rho_i = exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps, eps)));
    loss -mean_i A_i rho_i."""
    lr = logp - logq
    sign = torch.sign(adv)[:, None]
    clipped = sign * torch.min(sign * lr, sign * torch.clamp(lr, -eps, eps))
    rho = torch.exp((clipped * mask).sum(-1) / mask.sum(-1))
    return -(adv * rho).mean()


def cispo_loss(logp, logq, adv, mask, cap):
    """CISPO (MiniMax-M1): -sg[min(r, C)] A log p, token-mean."""
    r = torch.exp(logp - logq).detach()
    return -(torch.clamp(r, max=cap) * adv[:, None] * logp * mask).sum() / mask.sum()


def sapo_loss(logp, logq, adv, mask, tau_pos, tau_neg):
    """SAPO (2511.20347): -sigma(tau (r - 1)) (4 / tau) A, tau by the sign of A; mean over each
    sequence's tokens, then over sequences."""
    r = torch.exp(logp - logq)
    a = adv[:, None].expand_as(r)
    tau = torch.where(a > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    return seq_mean_token_mean(-torch.sigmoid(tau * (r - 1)) * 4 / tau * a, mask)


def dcpo_loss(logp, logq, adv, mask, eps_low, eps_high):
    """DCPO (2509.02333): PPO clip with 0.5 + 0.5 sqrt(max(1 - 4 eps_low/q, 0)) <= r <=
    min(0.5 + 0.5 sqrt(1 + 4 eps_high/q), 10) (the authors' code caps the upper bound at 10);
    token-mean."""
    q = logq.exp()
    lo = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * eps_low / q, min=0))
    hi = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high / q), max=10.0)
    r = torch.exp(logp - logq)
    a = adv[:, None].expand_as(r)
    surrogate = torch.min(r * a, torch.max(torch.min(r, hi), lo) * a)
    return -(surrogate * mask).sum() / mask.sum()
