"""`policy_loss`: the GPPO objective for one batch, with its metrics; `estimate`: D-hat alone.

The signature is engine-neutral: the trainer, the verl plugin and the TRL trainer all build a
`TokenBatch` and call `policy_loss(batch, config)` unchanged. For gradient accumulation or data
parallelism pass the mini-batch's global `num_tokens` / `num_sequences`, so that summing the
micro-batch losses gives exactly the mini-batch loss.
"""

from __future__ import annotations

import torch

from gppo.core.batch import GPPOInputError, TokenBatch, require, validate
from gppo.core.config import GPPOConfig
from gppo.core.estimators import LOG_RATIO_CLAMP, anchor_of, run_estimator
from gppo.core.numerics import upcast
from gppo.core.rules import RULES, RuleContext
from gppo.core.token_stats import logits_stats

# mu-probability buckets of the sampled token: the low-probability over-penalisation that
# motivates GPPO shows up as a high masked fraction in the first buckets.
Q_BUCKET_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 1.0)
Q_BUCKETS = tuple(f"q[{lo:g},{hi:g}{']' if hi == 1.0 else ')'}" for lo, hi in zip(Q_BUCKET_EDGES, Q_BUCKET_EDGES[1:]))


def q_buckets(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean membership of each probability in the buckets Q_BUCKETS (the last one closed)."""
    return {
        name: (q >= lo) & ((q < hi) if hi < 1 else (q <= hi))
        for name, lo, hi in zip(Q_BUCKETS, Q_BUCKET_EDGES, Q_BUCKET_EDGES[1:])
    }


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B,T] to a scalar (docs/design.md section 6).

    token-mean: sum l m / sum m;  seq-mean-token-mean: mean_i (sum_t l m / sum_t m);
    seq-mean-token-sum: mean_i sum_t l m;  seq-mean-token-sum-norm (Dr. GRPO): sum l m / (N L).
    Sequence means run over sequences with at least one token; L defaults to T.
    """
    m = mask.to(values.dtype)
    values = torch.where(mask.bool(), values, 0.0)
    if mode == "token-mean":
        return values.sum() / (num_tokens if num_tokens is not None else m.sum())
    lengths = m.sum(-1)
    n_seq = num_sequences if num_sequences is not None else (lengths > 0).sum()
    per_sequence = values.sum(-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = per_sequence / (norm_length or values.shape[-1])
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return per_sequence.sum() / n_seq


def reference_kl(batch: TokenBatch, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B,T], differentiable through logp (or logits for 'full').

    With x = log p - log p_ref: k1 = x, k2 = x^2 / 2, k3 = exp(-x) - 1 + x (Schulman 2020);
    full = sum_v pi_v (log pi_v - log ref_v), exact over the vocabulary (from TokenBatch.kl_ref_full
    when the caller computed it, else from logits and logp_ref_full).
    """
    valid = batch.token_mask
    if estimator == "full" and batch.kl_ref_full is not None:
        return torch.where(valid, upcast(batch.kl_ref_full), 0.0)
    if estimator == "full":
        require(batch, ["logits", "logp_ref_full"], "kl_estimator='full' (or TokenBatch.kl_ref_full)")
        return logits_stats(batch.logits, mask=valid, ref_log_probs=batch.logp_ref_full).kl_ref_full
    require(batch, ["logp_ref"], f"the KL penalty (kl_estimator={estimator!r})")
    x = torch.where(valid, upcast(batch.logp) - upcast(batch.logp_ref), 0.0)
    x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    return torch.expm1(-x) + x


def estimate(config: GPPOConfig, batch: TokenBatch) -> torch.Tensor:
    """D-hat [B,T] of `config.divergence` by `config.estimator` (no gradient; 0 where mask = 0)."""
    if config.estimator is None:
        raise GPPOInputError(
            f"this config (rule {config.rule!r}) has no estimator; set divergence and estimator "
            "to estimate a divergence"
        )
    validate(batch)
    return run_estimator(config, batch)


def behavior_weight(batch: TokenBatch, config: GPPOConfig, valid: torch.Tensor) -> torch.Tensor:
    """sg[w], w = pi_old/mu per token, or per sequence (prod_t, broadcast to its tokens) in the
    sequence_* modes, met with the band [behavior_weight_floor, behavior_weight_cap] as
    behavior_weight_mode says: *_truncate clamps w into it, *_mask sets w = 0 outside it (TRL's
    vllm_importance_sampling_mode; docs/design.md section 1)."""
    log_w = torch.where(valid, upcast(batch.logp_old) - upcast(batch.logp_behavior), 0.0).detach()
    level, how = config.behavior_weight_mode.split("_")
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    floor, cap = config.behavior_weight_floor, config.behavior_weight_cap
    if how == "truncate":
        return w.clamp(min=floor, max=cap)
    outside = torch.zeros_like(valid)
    if floor is not None:
        outside = outside | (w < floor)
    if cap is not None:
        outside = outside | (w > cap)
    return torch.where(outside, 0.0, w)


def policy_loss(
    batch: TokenBatch, config: GPPOConfig, *, num_tokens: float | None = None, num_sequences: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GPPO loss (scalar, to minimise) and its metrics.

    loss = agg_t(l_t) + kl_coef * agg_t(KL_t), l_t from `config.rule` on r = exp(log pi - log anchor).
    """
    if not isinstance(config, GPPOConfig):
        raise TypeError(f"config must be a gppo.GPPOConfig (gppo.preset(...)), got {type(config).__name__}")
    for name, count in (("num_tokens", num_tokens), ("num_sequences", num_sequences)):
        if count is not None and not bool((torch.as_tensor(count) > 0).all()):  # also refuses NaN
            raise GPPOInputError(
                f"policy_loss({name}={count}) must be > 0: pass the mini-batch's global {name.split('_')[1]} "
                "count, or None to count the batch's mask"
            )
    validate(batch)
    anchor = anchor_of(batch, config.anchor)
    valid = batch.token_mask
    # Padding may hold anything (even NaN): select it away so that neither the loss nor the
    # gradient ever reads it (torch.where passes no gradient to the unselected side).
    logp = torch.where(valid, upcast(batch.logp), 0.0)
    logq = torch.where(valid, anchor.logq.to(logp.dtype), 0.0)
    log_ratio = logp - logq
    # The clamp bounds the value of r (exp overflows float32 beyond log r = 88) but keeps the
    # gradient of log r: a hard clamp would silently zero the gradient of every token beyond it.
    clamped = log_ratio + (log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) - log_ratio).detach()
    ctx = RuleContext(
        config=config,
        batch=batch,
        adv=torch.where(valid, batch.token_advantages().to(logp.dtype), 0.0),
        valid=valid,
        logp=logp,
        log_ratio=clamped,
        logq=logq,
        raw_log_ratio=log_ratio.detach(),
    )
    out = RULES.lookup(config.rule).loss(ctx)
    per_token = out.loss
    if config.behavior_weight_cap is not None or config.behavior_weight_floor is not None:
        per_token = per_token * behavior_weight(batch, config, valid)
    agg = dict(
        mode=config.loss_agg_mode, norm_length=config.norm_length, num_tokens=num_tokens, num_sequences=num_sequences
    )
    pg_loss = aggregate(per_token, ctx.valid, **agg)
    loss = pg_loss
    kl = None
    if config.kl_coef > 0:
        kl = reference_kl(batch, config.kl_estimator)
        loss = loss + config.kl_coef * aggregate(kl, ctx.valid, **agg)
    elif batch.logp_ref is not None and config.kl_estimator != "full":  # monitored, not penalised
        kl = reference_kl(batch, config.kl_estimator)
    return loss, _metrics(ctx, out, pg_loss, kl)


def _metrics(ctx: RuleContext, out, pg_loss: torch.Tensor, kl: torch.Tensor | None) -> dict[str, float]:
    """Scalar metrics over valid tokens; one host sync. Groups with no tokens are left out."""
    valid = ctx.valid
    with torch.no_grad():
        vf = valid.float()
        n = vf.sum()
        r = ctx.ratio.detach()
        values: dict[str, torch.Tensor] = {
            "loss/policy": pg_loss.detach(),
            "ratio/mean": (r * vf).sum() / n,
            "ratio/min": torch.where(valid, r, torch.inf).min(),
            "ratio/max": torch.where(valid, r, -torch.inf).max(),
        }
        counts: dict[str, torch.Tensor] = {}  # metric -> number of tokens it averages over

        def frac(name: str, hit: torch.Tensor, group: torch.Tensor):
            values[name] = (hit & group).sum() / group.sum().clamp(min=1)
            counts[name] = group.sum()

        if out.blocked is not None:
            blocked = out.blocked & valid
            frac("masked_frac", blocked, valid)
            frac("masked_frac/adv_pos", blocked, valid & (ctx.adv > 0))
            frac("masked_frac/adv_neg", blocked, valid & (ctx.adv < 0))
            for name, bucket in q_buckets(ctx.logq.detach().exp()).items():
                group = valid & bucket
                frac(f"masked_frac/{name}", blocked, group)
                values[f"token_frac/{name}"] = group.sum() / n
        if ctx.config.truncation is not None:
            frac("truncated_frac", r > ctx.config.truncation, valid)
        if ctx.config.estimator is not None:
            est = ctx.estimate()
            values["divergence/mean"] = (est * vf).sum() / n
            values["divergence/max"] = torch.where(valid, est, 0.0).max()
        if kl is not None:
            values["kl_ref"] = (kl.detach() * vf).sum() / n
        if ctx.batch.entropy is not None:
            values["entropy"] = torch.where(valid, ctx.batch.entropy.detach().float(), 0.0).sum() / n
        elif ctx.batch.logits is not None:
            entropy = logits_stats(ctx.batch.logits.detach(), mask=valid, entropy=True).entropy
            values["entropy"] = entropy.sum() / n
        names = list(values)
        numbers = torch.stack(
            [values[k].float().reshape(()) for k in names] + [c.float().reshape(()) for c in counts.values()]
        ).tolist()
    result = dict(zip(names, numbers[: len(names)]))
    for name, count in zip(counts, numbers[len(names) :]):
        if count == 0:
            del result[name]
    return result
