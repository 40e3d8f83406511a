"""Rollouts as tensors, and the training forward pass that turns them into a `gppo.TokenBatch`.

Layout of a rollout of N sequences: prompts left-padded to P tokens, completions right-padded to
T tokens, so that `input_ids` is [N, P + T] and the logits that predict completion token t sit at
position P - 1 + t. Log-probs are log_softmax(logits / temperature), exactly as in the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

import gppo
from gppo.rollout.base import Generation


@dataclass
class Rollout:
    """One batch of sampled sequences and everything recorded about them ([N, ...] tensors)."""

    input_ids: torch.Tensor  # [N, P+T]
    attention_mask: torch.Tensor  # [N, P+T]
    prompt_length: int  # P
    response_mask: torch.Tensor  # [N, T] float
    token_ids: torch.Tensor  # [N, T]
    logp_behavior: torch.Tensor  # [N, T]
    advantages: torch.Tensor  # [N]
    topk_ids: torch.Tensor | None = None  # [N, T, K]
    topk_logp_behavior: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None
    topk_logp_old: torch.Tensor | None = None
    logp_behavior_full: torch.Tensor | None = None  # [N, T, V]
    logp_ref: torch.Tensor | None = None
    logp_ref_full: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """The sequences at `index`, trimmed to the columns any of them uses."""
        def pick(x):
            return x[index] if isinstance(x, torch.Tensor) else x
        sub = replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})
        used = sub.attention_mask.any(0).nonzero()
        first_prompt_col = int(used.min()) if used.numel() else 0
        first_prompt_col = min(first_prompt_col, sub.prompt_length - 1)
        last_response = int(sub.response_mask.any(0).nonzero().max()) + 1 if sub.response_mask.any() else 1
        end = sub.prompt_length + last_response
        trimmed = {"input_ids": sub.input_ids[:, first_prompt_col:end],
                   "attention_mask": sub.attention_mask[:, first_prompt_col:end],
                   "prompt_length": sub.prompt_length - first_prompt_col}
        for f in fields(self):
            value = getattr(sub, f.name)
            if f.name not in trimmed and isinstance(value, torch.Tensor) and value.dim() >= 2:
                trimmed[f.name] = value[:, :last_response]
        return replace(sub, **trimmed)


def rollout_from_generations(generations: list[Generation], advantages: torch.Tensor, pad_id: int,
                             top_k: int) -> Rollout:
    """Pad a list of generations into a Rollout (top-K kept only when top_k > 0)."""
    n = len(generations)
    P = max(len(g.prompt_ids) for g in generations)
    T = max(1, max(len(g.completion_ids) for g in generations))
    input_ids = torch.full((n, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((n, P + T), dtype=torch.long)
    response_mask = torch.zeros((n, T))
    token_ids = torch.full((n, T), pad_id, dtype=torch.long)
    logp = torch.zeros((n, T))
    topk_ids = torch.zeros((n, T, top_k), dtype=torch.long) if top_k else None
    topk_logp = torch.zeros((n, T, top_k)) if top_k else None
    for i, g in enumerate(generations):
        p, t = len(g.prompt_ids), len(g.completion_ids)
        input_ids[i, P - p:P] = torch.tensor(g.prompt_ids)
        attention[i, P - p:P + t] = 1
        if t:
            input_ids[i, P:P + t] = torch.tensor(g.completion_ids)
            token_ids[i, :t] = torch.tensor(g.completion_ids)
            response_mask[i, :t] = 1
            logp[i, :t] = torch.tensor(g.logprobs)
            if top_k:
                topk_ids[i, :t] = torch.tensor(g.topk_ids)[:, :top_k]
                topk_logp[i, :t] = torch.tensor(g.topk_logprobs)[:, :top_k]
    return Rollout(input_ids, attention, P, response_mask, token_ids, logp, advantages.float(),
                   topk_ids, topk_logp)


def response_logits(model, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Temperature-scaled logits [N, T, V] that predict each completion token."""
    position_ids = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=position_ids)
    P, T = rollout.prompt_length, rollout.token_ids.shape[1]
    return out.logits[:, P - 1:P - 1 + T].float() / (temperature if temperature > 0 else 1.0)


@dataclass
class PolicyOutputs:
    logp: torch.Tensor  # [N, T]
    topk_logp: torch.Tensor | None
    logits: torch.Tensor  # [N, T, V], temperature applied
    log_probs: torch.Tensor  # [N, T, V]


def policy_outputs(model, rollout: Rollout, temperature: float) -> PolicyOutputs:
    logits = response_logits(model, rollout, temperature)
    log_probs = torch.log_softmax(logits, -1)
    logp, topk = gppo.gather_logp(log_probs, rollout.token_ids, rollout.topk_ids)
    return PolicyOutputs(logp, topk, logits, log_probs)


def token_batch(rollout: Rollout, outputs: PolicyOutputs) -> gppo.TokenBatch:
    """The TokenBatch of a micro-batch: current policy from `outputs`, the rest from the rollout
    (logits are always passed: the entropy metric and the full estimator read them)."""
    return gppo.TokenBatch(
        logp=outputs.logp, logp_behavior=rollout.logp_behavior, advantages=rollout.advantages,
        mask=rollout.response_mask, logp_old=rollout.logp_old, token_ids=rollout.token_ids,
        topk_ids=rollout.topk_ids, topk_logp_behavior=rollout.topk_logp_behavior,
        topk_logp=outputs.topk_logp, topk_logp_old=rollout.topk_logp_old,
        logits=outputs.logits,
        logp_behavior_full=rollout.logp_behavior_full, logp_ref=rollout.logp_ref,
        logp_ref_full=rollout.logp_ref_full,
    )
