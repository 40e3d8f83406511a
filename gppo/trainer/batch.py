"""Rollouts as tensors: sampled sequences, everything recorded about them, and the TokenBatch of a
micro-batch (the training forward that scores them is `gppo.models.forward`).

Layout of a rollout of N sequences: prompts left-padded to P tokens, completions right-padded to
T tokens, so that `input_ids` is [N, P + T]; per-token fields are [N, T].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, replace

import torch

import gppo
from gppo.models.forward import PolicyOutputs
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
    logp_old_full: torch.Tensor | None = None  # [N, T, V]: estimator 'full' with anchor='old'
    logp_behavior_full: torch.Tensor | None = None  # [N, T, V]
    logp_ref: torch.Tensor | None = None
    logp_ref_full: torch.Tensor | None = None
    kept_sizes: torch.Tensor | None = None  # [N, T] |S_t| of top-p rollouts (0 at padding)
    kept_ids: list[torch.Tensor] | None = None  # per sequence: its S_t ids concatenated over t
    versions: torch.Tensor | None = None  # [N, T] long: the weights version (step) that sampled each token

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> Rollout:
        """The sequences at `index`, trimmed to the columns any of them uses."""

        def pick(x):
            if isinstance(x, list):
                return [x[i] for i in index.tolist()]
            return x[index] if isinstance(x, torch.Tensor) else x

        sub = replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})
        used = sub.attention_mask.any(0).nonzero()
        first_prompt_col = int(used.min()) if used.numel() else 0
        first_prompt_col = min(first_prompt_col, sub.prompt_length - 1)
        last_response = int(sub.response_mask.any(0).nonzero().max()) + 1 if sub.response_mask.any() else 1
        end = sub.prompt_length + last_response
        trimmed = {
            "input_ids": sub.input_ids[:, first_prompt_col:end],
            "attention_mask": sub.attention_mask[:, first_prompt_col:end],
            "prompt_length": sub.prompt_length - first_prompt_col,
        }
        for f in fields(self):
            value = getattr(sub, f.name)
            if f.name not in trimmed and isinstance(value, torch.Tensor) and value.dim() >= 2:
                trimmed[f.name] = value[:, :last_response]
        if sub.kept_ids is not None:  # the nuclei of the columns kept (tool tokens may follow the last model token)
            kept = trimmed["kept_sizes"].sum(1).tolist()
            trimmed["kept_ids"] = [ids[:n] for ids, n in zip(sub.kept_ids, kept)]
        return replace(sub, **trimmed)


def rollout_from_generations(
    generations: list[Generation], advantages: torch.Tensor, pad_id: int, top_k: int
) -> Rollout:
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
    top_p = any(g.kept_ids is not None for g in generations)
    kept_sizes = torch.zeros((n, T), dtype=torch.long) if top_p else None
    kept_ids = [] if top_p else None
    versions = torch.zeros((n, T), dtype=torch.long) if any(g.versions is not None for g in generations) else None
    for i, g in enumerate(generations):
        p, t = len(g.prompt_ids), len(g.completion_ids)
        input_ids[i, P - p : P] = torch.tensor(g.prompt_ids)
        attention[i, P - p : P + t] = 1
        if t:
            input_ids[i, P : P + t] = torch.tensor(g.completion_ids)
            token_ids[i, :t] = torch.tensor(g.completion_ids)
            # the model's tokens count; a tool's (gppo.rollout.tools) are context, never a term of the loss
            response_mask[i, :t] = 1 if g.tool_mask is None else torch.tensor(g.tool_mask, dtype=torch.float)
            logp[i, :t] = torch.tensor(g.logprobs)
            if versions is not None:
                versions[i, :t] = torch.tensor(g.versions)
            if top_k:
                topk_ids[i, :t] = torch.tensor(g.topk_ids)[:, :top_k]
                topk_logp[i, :t] = torch.tensor(g.topk_logprobs)[:, :top_k]
        if top_p:
            if g.kept_ids is None or len(g.kept_ids) != t:
                raise ValueError(
                    "every generation of a top-p rollout needs kept_ids, one set per token "
                    "(sample with SamplingParams(record_kept_ids=True))"
                )
            kept_sizes[i, :t] = torch.tensor([len(ids) for ids in g.kept_ids], dtype=torch.long)
            kept_ids.append(torch.tensor([a for ids in g.kept_ids for a in ids], dtype=torch.long))
    return Rollout(
        input_ids,
        attention,
        P,
        response_mask,
        token_ids,
        logp,
        advantages.float(),
        topk_ids,
        topk_logp,
        kept_sizes=kept_sizes,
        kept_ids=kept_ids,
        versions=versions,
    )


def token_batch(rollout: Rollout, outputs: PolicyOutputs) -> gppo.TokenBatch:
    """The TokenBatch of a micro-batch: the current policy's per-token quantities from `outputs`,
    the rest from the rollout."""
    return gppo.TokenBatch(
        logp=outputs.logp,
        logp_behavior=rollout.logp_behavior,
        advantages=rollout.advantages,
        mask=rollout.response_mask,
        logp_old=rollout.logp_old,
        token_ids=rollout.token_ids,
        topk_ids=rollout.topk_ids,
        topk_logp_behavior=rollout.topk_logp_behavior,
        topk_logp=outputs.topk_logp,
        topk_logp_old=rollout.topk_logp_old,
        logp_ref=rollout.logp_ref,
        entropy=outputs.entropy,
        full_estimate=outputs.full_estimate,
        kl_ref_full=outputs.kl_ref_full,
    )


def on_device(rollout: Rollout, device: torch.device) -> Rollout:
    """The rollout with its tensors on `device`."""
    return dataclasses.replace(
        rollout,
        **{
            f.name: getattr(rollout, f.name).to(device)
            for f in dataclasses.fields(rollout)
            if isinstance(getattr(rollout, f.name), torch.Tensor)
        },
    )


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """A micro-batch trimmed to its longest response, padded back to the rollout's width T (dim 1)."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]))
