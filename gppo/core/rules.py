"""Trust-region rules: how the estimate (or the ratio) turns into the per-token loss (docs/design.md section 4).

Every rule returns the per-token loss l_t [B,T] (to be aggregated) and which tokens had their
gradient blocked by the trust region (for metrics). Notation: r = pi/anchor of the sampled token,
A its advantage, sg[.] stop-gradient, C the truncation of the importance weight: with C set, no
token's gradient weight exceeds C (mask / truncate: sg[min(r, C)] log p; the others: their loss
times sg[min(x, C) / x], x the ratio they weight by). Each rule is one `Rule` in the registry `RULES`
(its parameters, whether it needs an estimate and which estimators it accepts); `register_rule`
adds one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gppo.core.estimators import ESTIMATORS, run_estimator
from gppo.core.params import check_params
from gppo.core.regions import dcpo_interval
from gppo.core.registry import Registry


@dataclass
class RuleContext:
    """Per-token quantities shared by the rules ([B,T], float32 or float64)."""

    config: object  # GPPOConfig (config imports this module's registry)
    batch: object  # TokenBatch
    adv: torch.Tensor
    valid: torch.Tensor  # bool
    logp: torch.Tensor  # differentiable
    log_ratio: torch.Tensor  # differentiable: value clamped to +-20, gradient that of log r
    logq: torch.Tensor  # anchor log-prob of the sampled token
    raw_log_ratio: torch.Tensor  # log p - log q unclamped, detached: decides region membership
    _estimate: torch.Tensor | None = field(default=None, repr=False)

    @property
    def ratio(self) -> torch.Tensor:
        return self.log_ratio.exp()

    def estimate(self) -> torch.Tensor:
        """D-hat [B,T] of config.divergence x config.estimator (no gradient), computed once."""
        if self._estimate is None:
            self._estimate = run_estimator(self.config, self.batch)
        return self._estimate

    def interval(self):
        """Per-token ratio interval [lo, hi] of the clip-style rules, in the loss dtype."""
        cfg = self.config
        if cfg.clip_bounds == "dcpo":
            lo, hi = dcpo_interval(self.logq.detach().double().exp(), cfg.delta_low, cfg.delta_high)
            return lo.to(self.logp.dtype), hi.to(self.logp.dtype)
        est = ESTIMATORS.lookup(cfg.estimator)
        if est.constant_interval is not None:  # scalar bounds: no per-token work
            lo, hi = est.constant_interval(cfg.divergence_fn, cfg.delta_low, cfg.delta_high)
            as_tensor = lambda x: torch.tensor(x, dtype=self.logp.dtype, device=self.logp.device)
            return as_tensor(lo), as_tensor(hi)
        lo, hi = est.ratio_interval(cfg.divergence_fn, self.logq.detach().double().exp(), cfg.delta_low, cfg.delta_high)
        return lo.to(self.logp.dtype), hi.to(self.logp.dtype)


@dataclass
class RuleOutput:
    loss: torch.Tensor  # per-token loss [B,T]
    blocked: torch.Tensor | None  # bool [B,T]: gradient zeroed by the trust region


def _truncation_weight(x: torch.Tensor, cap: float | None) -> torch.Tensor | float:
    """sg[min(x, C) / x]: multiplies a loss whose gradient weight is x so that it never exceeds C."""
    if cap is None:
        return 1.0
    x = x.detach()
    return x.clamp(max=cap) / x


def _policy_gradient(ctx: RuleContext, keep: torch.Tensor | None) -> torch.Tensor:
    """-A * w * keep, with gradient -A * min(r, C) * grad log p on kept tokens.

    C = inf: ratio form w = r. C finite: w = sg[min(r, C)] * log p (DPPO Eq. 12, CISPO)."""
    cap = ctx.config.truncation
    if cap is None:
        weight = ctx.ratio
    else:
        weight = ctx.ratio.detach().clamp(max=cap) * ctx.logp
    loss = -ctx.adv * weight
    return loss if keep is None else loss * keep


def _dual_clipped(ctx: RuleContext) -> torch.Tensor:
    c = ctx.config.dual_clip
    if c is None:
        return torch.zeros_like(ctx.valid)
    return (ctx.adv < 0) & (ctx.raw_log_ratio > math.log(c))


def _off_policy_masked(ctx: RuleContext) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (2512.02556, Eq. 9): the A<0 tokens of sequences
    whose mean_t log(mu / pi) exceeds off_policy_threshold, mu the rollout log-probs whatever the
    anchor; none when the threshold is unset."""
    threshold = ctx.config.off_policy_threshold
    if threshold is None:
        return torch.zeros_like(ctx.valid)
    log_mu = ctx.batch.logp_behavior.to(ctx.logp.dtype)
    drift = _sequence_mean(torch.where(ctx.valid, log_mu - ctx.logp.detach(), 0.0), ctx.valid)
    return (ctx.adv < 0) & (drift > threshold)[:, None]


def _clipped(x: torch.Tensor, raw_log_x: torch.Tensor, adv: torch.Tensor, lo, hi):
    """PPO's min(x A, clip(x, lo, hi) A) and the tokens it blocks, (A>0, x>hi) or (A<0, x<lo).

    Written as x A where free and the constant bound times A where blocked (the same value and
    gradient), with membership decided on the unclamped log x: a ratio beyond the +-20 clamp is
    still compared with its bound, however large the bound."""
    blocked_hi = (adv > 0) & (raw_log_x > torch.log(torch.as_tensor(hi, dtype=raw_log_x.dtype)))
    blocked_lo = (adv < 0) & (raw_log_x < torch.log(torch.as_tensor(lo, dtype=raw_log_x.dtype)))
    objective = torch.where(blocked_hi, hi * adv, torch.where(blocked_lo, lo * adv, x * adv))
    return objective, blocked_hi | blocked_lo


def _log_ratio_penalty(ctx: RuleContext) -> torch.Tensor | float:
    """tau (log r)^2 on every token, tau = kl_tau (prime-rl's KL term; DRO's (beta / 2)(log r)^2);
    0 when kl_tau is None."""
    tau = ctx.config.kl_tau
    return 0.0 if tau is None else tau * ctx.log_ratio.square()


def _outside(ctx: RuleContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens outside the region above (r>1, D>delta_high) and below (r<1, D>delta_low)."""
    est, lr, cfg = ctx.estimate(), ctx.raw_log_ratio, ctx.config
    return (lr > 0) & (est > cfg.delta_high), (lr < 0) & (est > cfg.delta_low)


def mask_rule(ctx: RuleContext) -> RuleOutput:
    """DPPO's directional mask: drop a token's gradient only when it is outside the region and the
    update pushes it further out: (A>0, r>1, D>delta_high) or (A<0, r<1, D>delta_low) (and
    DeepSeek-V3.2's off-policy sequences with off_policy_threshold); plus kl_tau (log r)^2 on every
    token when set (prime-rl's default loss)."""
    above, below = _outside(ctx)
    blocked = ((ctx.adv > 0) & above) | ((ctx.adv < 0) & below)
    blocked = blocked | _dual_clipped(ctx) | _off_policy_masked(ctx)
    loss = _policy_gradient(ctx, keep=(~blocked).float()) + _log_ratio_penalty(ctx)
    return RuleOutput(loss, blocked)


def band_rule(ctx: RuleContext) -> RuleOutput:
    """IcePop's band: drop every token outside the region, whatever the sign of A; IS-weighted
    policy gradient on the others. With TV x sample the kept band is 1 - 2 delta_low <= r <=
    1 + 2 delta_high."""
    above, below = _outside(ctx)
    blocked = above | below
    return RuleOutput(_policy_gradient(ctx, keep=(~blocked).float()), blocked)


def pg_rule(ctx: RuleContext) -> RuleOutput:
    """GPG / REINFORCE: -A log p, no importance weight and no region; with kl_tau, DRO's
    -(A log p - (beta / 2)(log r)^2), tau = beta / 2."""
    return RuleOutput(-ctx.adv * ctx.logp + _log_ratio_penalty(ctx), None)


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, 0.0).sum() / valid.sum()


def clip_cov_rule(ctx: RuleContext) -> RuleOutput:
    """Clip-Cov (2505.22617): PPO's clip, then detach max(1, floor(cov_ratio N)) tokens drawn
    uniformly (torch.randperm, as verl draws them) among the unclipped tokens whose covariance
    (A - mean A)(log p - mean log p) over the batch's N tokens lies in (cov_low, cov_high)."""
    out, cfg, valid = clip_rule(ctx), ctx.config, ctx.valid
    logp = ctx.logp.detach()
    cov = (ctx.adv - _masked_mean(ctx.adv, valid)) * (logp - _masked_mean(logp, valid))
    candidates = (valid & ~out.blocked & (cov > cfg.cov_low) & (cov < cfg.cov_high)).nonzero()
    count = max(int(cfg.cov_ratio * int(valid.sum())), 1)
    detached = torch.zeros_like(valid)
    if len(candidates):
        chosen = candidates[torch.randperm(len(candidates))[:count]]
        detached[chosen[:, 0], chosen[:, 1]] = True
    return RuleOutput(torch.where(detached, 0.0, out.loss), out.blocked | detached)


def kl_cov_rule(ctx: RuleContext) -> RuleOutput:
    """KL-Cov (2505.22617): -A r on every token, plus cov_kl_coef |log r| on the max(1,
    floor(cov_ratio N)) tokens of largest covariance (A - mean A)(log p - mean log p) over the
    batch's N tokens."""
    cfg, valid = ctx.config, ctx.valid
    adv, logp = ctx.adv[valid], ctx.logp.detach()[valid]
    cov = (adv - adv.mean()) * (logp - logp.mean())
    top = torch.topk(cov, max(1, int(len(cov) * cfg.cov_ratio))).indices
    selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    selected[valid.reshape(-1).nonzero().squeeze(-1)[top]] = True
    penalty = cfg.cov_kl_coef * ctx.log_ratio.abs() * selected.view_as(valid)
    return RuleOutput(-ctx.adv * ctx.ratio + penalty, None)


def gamma_rule(ctx: RuleContext) -> RuleOutput:
    """VESPO (2602.10693): -sg[phi(w_i)] A log p, w_i = exp(sum_t log r_it) the sequence ratio,
    phi(w) = w^k e^(lambda (1 - w)) (phi(1) = 1), (k, lambda) = (k_pos, lambda_pos) for A >= 0,
    (k_neg, lambda_neg) for A < 0; computed as exp(k log w + lambda (1 - w))."""
    cfg, adv = ctx.config, ctx.adv
    log_w = torch.where(ctx.valid, ctx.log_ratio.detach(), 0.0).sum(-1, keepdim=True)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, cfg.k_pos), cfg.k_neg)
    lam = torch.where(nonneg, torch.full_like(adv, cfg.lambda_pos), cfg.lambda_neg)
    phi = torch.exp(k * log_w + lam * (1 - log_w.exp()))
    return RuleOutput(-phi * adv * ctx.logp, None)


def truncate_rule(ctx: RuleContext) -> RuleOutput:
    """CISPO / PG-IS: no mask; -sg[min(r, C)] * A * log p (ratio form when C is None)."""
    return RuleOutput(_policy_gradient(ctx, keep=None), None)


def clip_rule(ctx: RuleContext) -> RuleOutput:
    """PPO: -min(r A, clip(r, lo, hi) A), [lo, hi] the region's ratio interval (PPO: 1 -+ eps);
    dual clip for A<0: -max(., c A); off_policy_threshold drops DeepSeek-V3.2's off-policy
    sequences. Same gradient as the mask rule on the same region."""
    lo, hi = ctx.interval()
    r, adv = ctx.ratio, ctx.adv
    objective, blocked = _clipped(r, ctx.raw_log_ratio, adv, lo, hi)
    if ctx.config.dual_clip is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, ctx.config.dual_clip * adv), objective)
        blocked = blocked | _dual_clipped(ctx)
    dropped = _off_policy_masked(ctx)
    objective = torch.where(dropped, 0.0, objective)
    return RuleOutput(-objective * _truncation_weight(r, ctx.config.truncation), blocked | dropped)


def soft_rule(ctx: RuleContext) -> RuleOutput:
    """SAPO's soft gate: -sigma(tau (r - 1)) * (4 / tau) * A, tau = tau_pos if A > 0 else tau_neg
    (gradient weight 4 sigma (1 - sigma) r, equal to 1 at r = 1)."""
    cfg = ctx.config
    tau = torch.where(ctx.adv > 0, torch.full_like(ctx.adv, cfg.tau_pos), cfg.tau_neg)
    gate = torch.sigmoid(tau * (ctx.ratio - 1)) * (4 / tau)
    return RuleOutput(-ctx.adv * gate * _truncation_weight(ctx.ratio, cfg.truncation), None)


def _sequence_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (x * valid).sum(-1) / valid.sum(-1).clamp(min=1)


def seq_clip_rule(ctx: RuleContext) -> RuleOutput:
    """GSPO(-token): s_i = exp(mean_t log r_it) with per-token gradient s_i grad log p_it,
    loss -min(s A, clip(s, lo, hi) A) with the sample-estimator interval (GSPO: 1 -+ eps)."""
    lo, hi = ctx.interval()
    seq_log_ratio = _sequence_mean(ctx.log_ratio.detach(), ctx.valid)
    s = torch.exp(seq_log_ratio[:, None] + ctx.logp - ctx.logp.detach())
    raw = _sequence_mean(ctx.raw_log_ratio, ctx.valid)[:, None].expand_as(s)
    objective, blocked = _clipped(s, raw, ctx.adv, lo, hi)
    return RuleOutput(-objective * _truncation_weight(s, ctx.config.truncation), blocked)


def geo_mean_rule(ctx: RuleContext) -> RuleOutput:
    """GMPO: rho_i = exp(mean_t l'_it), l' = log r clipped to [log lo, log hi] in the harmful
    direction only (A>0: min(log r, log hi); A<0: max(log r, log lo)); loss -A_i rho_i on every
    token of sequence i (use seq-mean-token-mean to get GMPO's mean_i)."""
    lo, hi = ctx.interval()
    log_lo, log_hi = torch.log(lo), torch.log(hi)
    lr, raw, adv = ctx.log_ratio, ctx.raw_log_ratio, ctx.adv
    above, below = (adv > 0) & (raw > log_hi), (adv <= 0) & (raw < log_lo)  # decided unclamped
    clipped = torch.where(above, log_hi, torch.where(below, log_lo, lr))
    rho = torch.exp(_sequence_mean(clipped, ctx.valid))
    blocked = above | (below & (adv < 0))
    rho = rho[:, None] * _truncation_weight(rho[:, None], ctx.config.truncation)
    return RuleOutput(-adv * rho, blocked)


def seq_mask_rule(ctx: RuleContext) -> RuleOutput:
    """Trust Region Masking: drop sequence i when max_t (or mean_t) D-hat_it > delta_high;
    IS-weighted policy gradient on the sequences kept."""
    est = ctx.estimate()
    if ctx.config.seq_reduce == "max":
        stat = torch.where(ctx.valid, est, -math.inf).amax(-1)
    else:
        stat = _sequence_mean(est, ctx.valid)
    keep = (stat <= ctx.config.delta_high)[:, None].expand_as(est)
    return RuleOutput(_policy_gradient(ctx, keep=keep.float()), ~keep & ctx.valid)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """sum_{j < t} x_j along the last dimension."""
    return torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1).cumsum(-1)


def prefix_mask_rule(ctx: RuleContext) -> RuleOutput:
    """CPPO (2606.10968, Eq. 8-10, Algorithm 1): DPPO's directional mask with a position-weighted
    threshold and a cumulative prefix budget. Per response of T tokens, t = 1..T:
    w_t = 1 - (1 - w_min)(t - 1)/(T - 1), Z_t = w_t D-hat_t, S and W the prefix sums of Z and w;
    a token whose update moves r away from 1 (A (r - 1) > 0) keeps its gradient only when
    Z_t <= min(delta, delta + delta_b W_{t-1} - S_{t-1}), delta = delta_high. delta_b =
    prefix_budget, or with prefix_budget_mode 'p90' clamp(P90_t D-hat_t, delta_b, 2 delta_b) per
    response (the paper's Base-model setting)."""
    cfg, valid = ctx.config, ctx.valid
    est = torch.where(valid, ctx.estimate(), 0.0)
    position = valid.cumsum(-1).to(est.dtype)  # t among the response's tokens
    length = valid.sum(-1, keepdim=True).to(est.dtype)
    weight = 1 - (1 - cfg.position_weight_min) * (position - 1) / (length - 1).clamp(min=1)
    weight = torch.where(valid, weight, 0.0)
    weighted = weight * est
    budget = cfg.prefix_budget
    if cfg.prefix_budget_mode == "p90":
        # torch.quantile's linear interpolation over each response's own tokens (NaN elsewhere)
        p90 = torch.nanquantile(torch.where(valid, est, math.nan), 0.9, dim=-1, keepdim=True)
        budget = p90.nan_to_num(budget).clamp(min=budget, max=2 * budget)
    delta = cfg.delta_high
    threshold = torch.clamp(delta + budget * _exclusive_cumsum(weight) - _exclusive_cumsum(weighted), max=delta)
    lr = ctx.raw_log_ratio
    away = ((ctx.adv > 0) & (lr > 0)) | ((ctx.adv < 0) & (lr < 0))
    blocked = valid & away & (weighted > threshold)
    return RuleOutput(_policy_gradient(ctx, keep=(~blocked).float()), blocked)


def quadratic_rule(ctx: RuleContext) -> RuleOutput:
    """DRPO (2606.09821, Eq. 8): -A r + |A| q (r - 1)^2 / (2 delta), q the anchor's probability of
    the sampled token, delta = quadratic_delta. Its gradient is -A r grad log p times
    1 - sign(A (r - 1)) |p - q| / delta (the paper's Table 1): the binary-TV geometry, smoothly."""
    q = ctx.logq.detach().exp()
    r = ctx.ratio
    penalty = ctx.adv.abs() * q * (r - 1).square() / (2 * ctx.config.quadratic_delta)
    return RuleOutput(-ctx.adv * r + penalty, None)


@dataclass(frozen=True)
class Rule:
    """A trust-region rule: loss(ctx) -> RuleOutput, and what it needs of the point.

    params: the GPPOConfig fields it reads. uses_estimate: whether it reads divergence x estimator
    (a bool, or a function of the config for a rule whose parameters decide it: clip with DCPO
    bounds uses none). ratio_interval: it clips the sampled token's ratio, so the estimator must
    have a ratio interval. estimators: the only estimators it accepts (None: any).
    advantage_linear: whether the per-token loss has l(w A) = w l(A) for every w >= 0 (a bool, or a
    function of the config), so that a per-token weight can be folded into A (the verl plugin).
    """

    name: str
    loss: Callable[[RuleContext], RuleOutput]
    params: tuple[str, ...] = ()
    uses_estimate: bool | Callable = True
    ratio_interval: bool = False
    estimators: tuple[str, ...] | None = None
    summary: str = ""
    advantage_linear: bool | Callable = True

    def needs_estimate(self, config) -> bool:
        return self.uses_estimate(config) if callable(self.uses_estimate) else self.uses_estimate

    def is_advantage_linear(self, config) -> bool:
        linear = self.advantage_linear
        return linear(config) if callable(linear) else linear


_DELTAS = ("delta_low", "delta_high")


def _no_penalty(cfg) -> bool:
    """The kl_tau penalty does not scale with A: a rule reading it is advantage-linear without it."""
    return cfg.kl_tau is None


RULES = Registry("rule")
for _rule in (
    Rule(
        "mask",
        mask_rule,
        (*_DELTAS, "dual_clip", "truncation", "kl_tau", "off_policy_threshold"),
        advantage_linear=_no_penalty,
        summary="DPPO's directional mask",
    ),
    Rule(
        "clip",
        clip_rule,
        (*_DELTAS, "clip_bounds", "dual_clip", "truncation", "off_policy_threshold"),
        uses_estimate=lambda cfg: cfg.clip_bounds != "dcpo",
        ratio_interval=True,
        summary="PPO clip of the ratio to the region's interval (or DCPO's bounds)",
    ),
    Rule("soft", soft_rule, ("tau_pos", "tau_neg", "truncation"), uses_estimate=False, summary="SAPO's soft gate"),
    Rule(
        "truncate",
        truncate_rule,
        ("truncation",),
        uses_estimate=False,
        summary="CISPO / truncated IS policy gradient, no region",
    ),
    Rule(
        "seq-clip",
        seq_clip_rule,
        (*_DELTAS, "truncation"),
        ratio_interval=True,
        estimators=("sample",),
        summary="GSPO clip of the sequence ratio",
    ),
    Rule(
        "geo-mean",
        geo_mean_rule,
        (*_DELTAS, "truncation"),
        ratio_interval=True,
        summary="GMPO geometric-mean sequence weight",
    ),
    Rule(
        "seq-mask",
        seq_mask_rule,
        ("delta_high", "seq_reduce", "truncation"),
        summary="Trust Region Masking: drop a sequence whose max (or mean) estimate exceeds delta_high",
    ),
    Rule(
        "band",
        band_rule,
        (*_DELTAS, "truncation"),
        summary="IcePop: drop every token outside the region, whatever the sign of A",
    ),
    Rule(
        "pg",
        pg_rule,
        ("kl_tau",),
        uses_estimate=False,
        advantage_linear=_no_penalty,
        summary="GPG / REINFORCE -A log p, no importance weight (DRO with kl_tau)",
    ),
    Rule(
        "clip-cov",
        clip_cov_rule,
        (*_DELTAS, "cov_ratio", "cov_low", "cov_high"),
        ratio_interval=True,
        advantage_linear=False,
        summary="Clip-Cov: PPO clip, gradient detached on random tokens of high covariance",
    ),
    Rule(
        "kl-cov",
        kl_cov_rule,
        ("cov_ratio", "cov_kl_coef"),
        uses_estimate=False,
        advantage_linear=False,
        summary="KL-Cov: ratio PG, |log r| penalty on the tokens of highest covariance",
    ),
    Rule(
        "prefix-mask",
        prefix_mask_rule,
        ("delta_high", "position_weight_min", "prefix_budget", "prefix_budget_mode", "truncation"),
        summary="CPPO: directional mask, position-weighted threshold and cumulative prefix budget",
    ),
    Rule(
        "quadratic",
        quadratic_rule,
        ("quadratic_delta",),
        uses_estimate=False,
        summary="DRPO: ratio PG plus the advantage-weighted penalty |A| q (r-1)^2 / (2 delta)",
    ),
    Rule(
        "gamma",
        gamma_rule,
        ("k_pos", "lambda_pos", "k_neg", "lambda_neg"),
        uses_estimate=False,
        summary="VESPO's gamma weight of the sequence ratio",
    ),
):
    RULES.add(_rule.name, _rule, builtin=True)


def register_rule(
    name: str,
    *,
    params=(),
    uses_estimate: bool = True,
    ratio_interval: bool = False,
    estimators=None,
    summary: str = "",
    advantage_linear: bool = True,
):
    """Decorator registering a trust-region rule: fn(ctx: RuleContext) -> RuleOutput.

    ctx gives the per-token adv, valid, logp (differentiable), log_ratio, ratio, logq, estimate()
    (D-hat, when uses_estimate) and interval() (when ratio_interval), and ctx.config; `params` are
    the GPPOConfig fields fn reads (e.g. ("delta_high", "truncation")); advantage_linear=False
    when the loss is not proportional to A (a penalty, a selection by A).
    """
    RULES.check_new(name)
    check_params(f"rule {name!r}", params)
    if estimators is not None:
        for est in estimators:
            ESTIMATORS.lookup(est)

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"register_rule({name!r}) decorates a function, got {type(fn).__name__}")
        RULES.add(
            name,
            Rule(
                name,
                fn,
                tuple(params),
                uses_estimate,
                ratio_interval,
                None if estimators is None else tuple(estimators),
                summary or (fn.__doc__ or "").strip().split("\n")[0],
                advantage_linear,
            ),
        )
        return fn

    return decorate
