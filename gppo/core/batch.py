"""`TokenBatch`: the per-token tensors the GPPO objective reads, and their validation.

Shapes: B sequences, T response positions, K recorded top-K entries, V vocabulary.
All log-probabilities are natural logs under the sampling temperature (the trainer and the
rollout engine must apply the same temperature).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import torch


class GPPOInputError(ValueError):
    """A TokenBatch that the objective cannot use; the message names the field and the fix."""


@dataclass
class TokenBatch:
    """Per-token inputs of `gppo.policy_loss` and `gppo.estimate`.

    Required:
        logp [B,T]: log pi(a_t | s_t) of the current policy (differentiable).
        logp_behavior [B,T]: log mu(a_t | s_t) recorded by the rollout engine.
        advantages [B] or [B,T]: sequence- or token-level advantages.
        mask [B,T]: 1 for response tokens that count, 0 for padding / prompt.
    Optional (each estimator or option says which it needs):
        logp_old [B,T]: log pi_old recomputed before the update (anchor='old').
        token_ids [B,T]: sampled token ids (topk / topp decide membership by id).
        topk_ids [B,T,K]: mu's top-K token ids; topk_logp_behavior [B,T,K]: mu's log-probs there;
        topk_logp [B,T,K]: current policy's log-probs at topk_ids (from the training forward);
        topk_logp_old [B,T,K]: pi_old's log-probs at topk_ids (topk/topp with anchor='old').
        logits [B,T,V]: current policy logits, temperature applied (estimator 'full', entropy,
            exact reference KL); logp_behavior_full / logp_old_full [B,T,V]: the anchor's
            full log-distribution (estimator 'full').
        logp_ref [B,T]: reference-model log-probs (KL penalty k1/k2/k3);
        logp_ref_full [B,T,V]: reference log-distribution (exact KL penalty, kl_estimator='full').
    Per-token reductions over the vocabulary, computed by the caller one chunk of tokens at a time
    (`gppo.token_stats` from hidden states), in place of the [B,T,V] fields above:
        entropy [B,T]: the current policy's entropy (the entropy metric; differentiable);
        full_estimate [B,T]: exact D_f(pi || anchor) of the config's divergence over the
            vocabulary (estimator 'full' reads it instead of logits and the anchor's distribution);
        kl_ref_full [B,T]: exact KL(pi || ref) (kl_estimator='full'; differentiable).
    """

    logp: torch.Tensor
    logp_behavior: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    logp_old: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logp_behavior: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    topk_logp_old: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logp_behavior_full: torch.Tensor | None = None
    logp_old_full: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    logp_ref_full: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    full_estimate: torch.Tensor | None = None
    kl_ref_full: torch.Tensor | None = None

    @property
    def token_mask(self) -> torch.Tensor:
        """The mask as a boolean [B,T] tensor."""
        return self.mask.bool()

    def token_advantages(self) -> torch.Tensor:
        """Advantages broadcast to [B,T]."""
        adv = self.advantages
        return adv[:, None].expand_as(self.logp) if adv.dim() == 1 else adv


REQUIRED_FIELDS = tuple(f.name for f in fields(TokenBatch) if f.default is MISSING)  # always given

# How to obtain each optional field, for error messages.
HOW_TO_RECORD = {
    "logp_old": "recompute the policy's log-probs before the update (the trainer does this when "
    "anchor='old'), or use anchor='behavior'",
    "token_ids": "pass the sampled token ids [B,T] (the response ids) so that top-K membership is "
    "decided by id, not by comparing log-prob values",
    "topk_ids": "record mu's top-K token ids at rollout (gppo's engines do it when the preset's "
    "top_k > 0; with vLLM request logprobs=K)",
    "topk_logp_behavior": "record mu's top-K log-probs at rollout together with topk_ids",
    "topk_logp": "gather the current policy's log-probs at topk_ids from the training forward "
    "pass: log_softmax(logits).gather(-1, topk_ids)",
    "topk_logp_old": "gather pi_old's log-probs at topk_ids when recomputing logp_old",
    "logits": "pass the current policy's logits [B,T,V] (temperature applied)",
    "logp_behavior_full": "record mu's full log-distribution [B,T,V] at rollout, or recompute it",
    "logp_old_full": "recompute pi_old's full log-distribution [B,T,V]",
    "logp_ref": "compute the reference model's log-probs of the sampled tokens",
    "logp_ref_full": "compute the reference model's full log-distribution [B,T,V]",
    "entropy": "pass the policy's per-token entropy [B,T] (gppo.token_stats(..., entropy=True)) or logits",
    "full_estimate": "pass the exact per-token D_f [B,T] (gppo.token_stats(..., anchor_log_probs=, "
    "divergence=config.divergence_fn)) or the logits and the anchor's full log-distribution",
    "kl_ref_full": "pass the exact per-token KL(pi || ref) [B,T] (gppo.token_stats(..., "
    "ref_log_probs=)) or the logits and logp_ref_full",
}

_LOGPROB_FIELDS = ("logp", "logp_behavior", "logp_old", "logp_ref")
_TOPK_FIELDS = ("topk_logp_behavior", "topk_logp", "topk_logp_old")
_FULL_FIELDS = ("logits", "logp_behavior_full", "logp_old_full", "logp_ref_full")
_REDUCED_FIELDS = ("entropy", "full_estimate", "kl_ref_full")  # [B,T], >= 0
# A log-prob above this is not rounding (bf16 arithmetic near |x| ~ 20 errs by < 0.07): it is a
# probability > 1.1, e.g. logits or a negative log-likelihood passed as log-probs.
LOGP_MAX = 0.1


def require(batch: TokenBatch, names, why: str) -> None:
    """Raise a GPPOInputError naming the first missing field in `names`, what needs it and the fix."""
    for name in names:
        if getattr(batch, name) is None:
            raise GPPOInputError(f"TokenBatch.{name} is missing but {why} needs it: {HOW_TO_RECORD[name]}")


def validate(batch: TokenBatch) -> None:
    """Check shapes, dtypes, finiteness and a non-empty mask; one host sync for all value checks."""
    if not isinstance(batch, TokenBatch):
        raise GPPOInputError(f"expected a gppo.TokenBatch, got {type(batch).__name__}")
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is not None and not isinstance(value, torch.Tensor):
            raise GPPOInputError(f"TokenBatch.{f.name} must be a torch.Tensor, got {type(value).__name__}")
    if batch.logp.dim() != 2:
        raise GPPOInputError(f"TokenBatch.logp must be [B,T], got shape {tuple(batch.logp.shape)}")
    bt = tuple(batch.logp.shape)
    for name in ("logp_behavior", "mask", "logp_old", "token_ids", "logp_ref", *_REDUCED_FIELDS):
        value = getattr(batch, name)
        if value is not None and tuple(value.shape) != bt:
            raise GPPOInputError(
                f"TokenBatch.{name} has shape {tuple(value.shape)} but logp has {bt}: every "
                "per-token field must be [B,T] with the same B and T"
            )
    adv = batch.advantages
    if tuple(adv.shape) not in (bt[:1], bt):
        raise GPPOInputError(
            f"TokenBatch.advantages has shape {tuple(adv.shape)}: expected [B]={bt[:1]} "
            f"(one per sequence) or [B,T]={bt} (one per token)"
        )
    topk = [n for n in ("topk_ids", *_TOPK_FIELDS) if getattr(batch, n) is not None]
    if topk:
        k_shape = tuple(getattr(batch, topk[0]).shape)
        if len(k_shape) != 3 or k_shape[:2] != bt:
            raise GPPOInputError(f"TokenBatch.{topk[0]} has shape {k_shape}: expected [B,T,K] with [B,T]={bt}")
        for name in topk[1:]:
            if tuple(getattr(batch, name).shape) != k_shape:
                raise GPPOInputError(
                    f"TokenBatch.{name} has shape {tuple(getattr(batch, name).shape)} but "
                    f"{topk[0]} has {k_shape}: all top-K fields share [B,T,K]"
                )
    for name in ("token_ids", "topk_ids"):
        value = getattr(batch, name)
        if value is not None and value.is_floating_point():
            raise GPPOInputError(f"TokenBatch.{name} must hold integer token ids, got {value.dtype}")
    full = [n for n in _FULL_FIELDS if getattr(batch, n) is not None]
    for name in full:
        shape = tuple(getattr(batch, name).shape)
        if len(shape) != 3 or shape[:2] != bt or shape[2] != tuple(getattr(batch, full[0]).shape)[2]:
            raise GPPOInputError(
                f"TokenBatch.{name} has shape {shape}: expected [B,T,V] with [B,T]={bt} and the same V as {full[0]}"
            )

    # Value checks, gathered so that the host waits for the device once.
    valid = batch.token_mask
    checks = {"mask holds values other than 0 and 1": ((batch.mask != 0) & (batch.mask != 1)).any()}
    checks["mask is empty"] = ~valid.any()
    for name in _LOGPROB_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            checks[f"TokenBatch.{name} is not finite"] = (~torch.isfinite(value) & valid).any()
    for name in _REDUCED_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            checks[f"TokenBatch.{name} is not finite"] = (~torch.isfinite(value) & valid).any()
    checks["TokenBatch.advantages is not finite"] = (~torch.isfinite(batch.token_advantages()) & valid).any()
    for name in _TOPK_FIELDS:  # -inf is a legitimate zero-probability entry; NaN and +inf are not
        value = getattr(batch, name)
        if value is not None:
            checks[f"TokenBatch.{name} has NaN or +inf"] = (
                (torch.isnan(value) | (value == float("inf"))) & valid[..., None]
            ).any()
    for name in (*_LOGPROB_FIELDS, *_TOPK_FIELDS, *_FULL_FIELDS[1:]):
        value = getattr(batch, name)
        if value is not None:
            largest = value.detach().amax(-1) if value.dim() == 3 else value  # [B,T]: no [B,T,V] temporary
            checks[f"TokenBatch.{name} has log-probs > 0"] = ((largest > LOGP_MAX) & valid).any()
    # [B,T,V] fields: one row sum each, no [B,T,V] temporary. A row sums to NaN or +inf iff it
    # holds NaN or +inf (-inf is a masked vocabulary column), barring overflow of finite values.
    for name in _FULL_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            row = value.detach().sum(-1)
            checks[f"TokenBatch.{name} has NaN or +inf"] = ((torch.isnan(row) | (row == float("inf"))) & valid).any()
    flags = torch.stack([c.reshape(()) for c in checks.values()]).tolist()
    failed = [msg for msg, bad in zip(checks, flags) if bad]
    if failed:
        hints = {
            "mask is empty": "every response has zero tokens: drop empty responses before the loss, "
            "or check that the mask marks response tokens with 1",
            "mask holds values other than 0 and 1": "pass a boolean or 0/1 mask",
        }
        msg = failed[0]
        if msg.endswith("log-probs > 0"):
            hints[msg] = (
                "a probability above 1: pass log-probabilities (log_softmax of the "
                "logits, <= 0), not logits, probabilities or negative log-likelihoods"
            )
        hint = hints.get(
            msg, "at a masked-in position; check the rollout log-probs and the temperature, or mask such tokens out"
        )
        raise GPPOInputError(f"{msg}: {hint}")


def gather_logp(log_probs: torch.Tensor, token_ids: torch.Tensor, topk_ids: torch.Tensor | None = None):
    """(logp [..., T], topk_logp [..., T, K] or None): the log-probs [..., T, V] of the sampled
    tokens and of mu's top-K ids, read with ONE gather. Two gathers would cost a second dense
    [..., T, V] gradient in backward: about +30 % on the log-softmax's time (benchmarks/)."""
    if topk_ids is None:
        return log_probs.gather(-1, token_ids[..., None]).squeeze(-1), None
    both = log_probs.gather(-1, torch.cat([token_ids[..., None], topk_ids], dim=-1))
    return both[..., 0], both[..., 1:]
