"""The training forward: a causal LM's per-token log-probs of sampled sequences, and what the
GPPO objective reads beyond them, from the last hidden states one chunk of tokens at a time.

Layout of N sequences: prompts left-padded to P tokens, completions right-padded to T tokens, so
that `input_ids` is [N, P + T] and the hidden state that predicts completion token t sits at
position P - 1 + t. Log-probs are log_softmax(logits / temperature), exactly as in the rollout;
they are computed from the hidden states at the completion positions alone (`gppo.token_stats`),
so the training forward never holds [N, T, V] logits.

Top-p rollouts (`kept_sizes`/`kept_ids`, the nucleus S_t mu sampled from at every token): every
model scored on the rollout (pi, pi_old, the reference) is scored on the same truncated,
renormalised distribution, pi_S(a) = pi(a) / pi(S_t) on S_t and 0 elsewhere, so that
r = pi_S / mu_S is exactly 1 before the first update (scoring pi on the whole vocabulary would
give r = pi(S_t) < 1: the bias of TRL issue 6789). Outside S_t both mu_S and pi_S are 0: such
top-K entries are cells of mass 0 under both, which add nothing to any D_f (0 f(0/0) = 0), so with
|S_t| <= K the top-K estimator is the exact D_f(pi_S || mu_S). S_t stays mu's set during the
update: mass pi moves outside S_t is not seen by the trust region, as it is not sampled by mu.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

import gppo


class ScoredSequences(Protocol):
    """What the forward reads of a batch of sampled sequences (`gppo.trainer.batch.Rollout` is one)."""

    input_ids: torch.Tensor  # [N, P+T]
    attention_mask: torch.Tensor  # [N, P+T]
    prompt_length: int  # P
    response_mask: torch.Tensor  # [N, T]
    token_ids: torch.Tensor  # [N, T]
    topk_ids: torch.Tensor | None  # [N, T, K]
    kept_sizes: torch.Tensor | None  # [N, T]
    kept_ids: list[torch.Tensor] | None
    logp_behavior_full: torch.Tensor | None  # [N, T, V]
    logp_old_full: torch.Tensor | None
    logp_ref_full: torch.Tensor | None


def decoder_and_output_layer(model):
    """(the decoder stack, the output layer) of a causal LM whose logits are output_layer(hidden):
    gppo scores tokens from the last hidden states (`gppo.token_stats`), never from full logits.
    A model that transforms its logits further (soft-capping, a logit scale) is refused."""
    head = model.get_output_embeddings()
    reshaped = [
        name
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling")
        if getattr(model.config, name, None) not in (None, 1, 1.0)
    ]
    if not isinstance(head, torch.nn.Linear) or reshaped:
        raise ValueError(
            f"{type(model).__name__}: gppo computes log-probs from the last hidden states through "
            f"a linear output layer, but this model's logits are not that"
            f"{' (config ' + ', '.join(reshaped) + ')' if reshaped else ''}; use a causal LM whose "
            "logits are lm_head(hidden_states)"
        )
    return model.get_decoder(), head


@dataclass(frozen=True)
class ForwardOptions:
    """How the training forward runs (docs/guide.md, "Memory and speed").

    share_prompt: the completions of one prompt share one forward of the prompt (its key/value cache
    is computed once and expanded to every completion; the gradient flows back through it once).
    chunk_size: tokens whose [tokens, V] logits exist at once (None: about 2**24 logits).
    autocast: a lower-precision dtype for the forward (bfloat16 mixed precision), or None."""

    share_prompt: bool = True
    chunk_size: int | None = None
    autocast: torch.dtype | None = None


def enable_activation_checkpointing(model) -> None:
    """transformers' per-layer activation checkpointing, non-reentrant (recent transformers name it
    activation_checkpointing_enable, deprecating gradient_checkpointing_enable)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def drops_cache_in_backward(model) -> bool:
    """True when a forward of `model` now would recompute its layers in the backward without
    their key/value cache (activation checkpointing, training mode, gradients on)."""
    return (
        model.training
        and torch.is_grad_enabled()
        and any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    )


def completion_hidden_states(model, rollout: ScoredSequences, share_prompt: bool = True) -> torch.Tensor:
    """The last hidden states [N, T, H] that predict each completion token: position P - 1 + t.

    With share_prompt, each distinct prompt (ids and padding) runs once; its key/value cache is
    expanded to the rows of its completions, which then run alone (the same values as the whole
    forward, up to the order of float additions)."""
    decoder, _ = decoder_and_output_layer(model)
    if share_prompt and drops_cache_in_backward(model):
        raise ValueError(
            "share_prompt needs the prompt's key/value cache, which activation checkpointing drops "
            "in training mode: pass ForwardOptions(share_prompt=False) with checkpointing"
        )
    ids, mask = rollout.input_ids, rollout.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    P, T = rollout.prompt_length, rollout.token_ids.shape[1]
    prompts, rows_of = torch.unique(torch.cat([ids[:, :P], mask[:, :P]], 1), dim=0, return_inverse=True)
    if not share_prompt or len(prompts) == len(ids):
        hidden = decoder(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return hidden[:, P - 1 : P - 1 + T]
    first = torch.empty(len(prompts), dtype=torch.long, device=ids.device)
    first[rows_of] = torch.arange(len(ids), device=ids.device)  # one row of each distinct prompt
    cache_kw = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    out = decoder(
        input_ids=ids[first, :P],
        attention_mask=mask[first, :P],
        position_ids=position_ids[first, :P],
        use_cache=True,
        **{cache_kw: DynamicCache(config=model.config)},
    )
    last_prompt = out.last_hidden_state[rows_of, -1:]
    if T == 1:
        return last_prompt
    cache = getattr(out, cache_kw)  # the output field has the argument's name
    cache.batch_select_indices(rows_of)  # differentiable indexing: the gradient sums over the group
    rest = decoder(
        input_ids=ids[:, P : P + T - 1],
        attention_mask=mask[:, : P + T - 1],
        position_ids=position_ids[:, P : P + T - 1],
        use_cache=True,
        **{cache_kw: cache},
    )
    return torch.cat([last_prompt, rest.last_hidden_state], 1)


@dataclass
class PolicyOutputs:
    """Per-token outputs of the training forward, [N, T] (0 at padding); None where not asked for."""

    logp: torch.Tensor
    topk_logp: torch.Tensor | None = None  # [N, T, K]
    entropy: torch.Tensor | None = None
    full_estimate: torch.Tensor | None = None
    kl_ref_full: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None  # [N, T, V], only with return_log_probs


def _nuclei_at(rollout, valid: torch.Tensor) -> torch.Tensor:
    """The nucleus ids of the positions in `valid`, concatenated in order (a tool's tokens have a
    nucleus, the token alone, but no term: gppo.rollout.tools)."""
    ids = torch.cat(rollout.kept_ids).to(valid.device)
    return ids[valid.flatten().repeat_interleave(rollout.kept_sizes.flatten())]


def policy_outputs(
    model,
    rollout: ScoredSequences,
    temperature: float,
    config: gppo.GPPOConfig | None = None,
    *,
    entropy: bool = False,
    return_log_probs: bool = False,
    options: ForwardOptions = ForwardOptions(),
) -> PolicyOutputs:
    """The model's per-token log-probs of the rollout (log_softmax(logits / temperature), on the
    top-p nucleus S_t when the rollout has one), and what `config`'s loss reads beyond them: the
    exact D_f to the anchor's full distribution (estimator 'full') and the exact KL to the
    reference's (kl_estimator 'full'), all from the hidden states at the completion positions only,
    one chunk of tokens at a time (`gppo.token_stats`): no [N, T, V] tensor is made, except the
    full log-distribution when `return_log_probs` asks for it."""
    _, head = decoder_and_output_layer(model)
    valid = rollout.response_mask.bool()
    with torch.autocast(rollout.input_ids.device.type, options.autocast, enabled=options.autocast is not None):
        hidden = completion_hidden_states(model, rollout, options.share_prompt)[valid]
    weight, bias = head.weight, head.bias
    if options.autocast is not None:  # the output layer in the forward's precision, as autocast runs it
        weight, bias = weight.to(options.autocast), None if bias is None else bias.to(options.autocast)
    anchor_full = ref_full = None
    if config is not None and config.anchor_distribution is not None:
        anchor_full = getattr(rollout, config.anchor_distribution)[valid]
    if config is not None and config.reference_distribution is not None:
        ref_full = getattr(rollout, config.reference_distribution)[valid]
    stats = gppo.token_stats(
        hidden,
        weight,
        rollout.token_ids[valid],
        bias=bias,
        temperature=temperature,
        topk_ids=None if rollout.topk_ids is None else rollout.topk_ids[valid],
        kept_sizes=None if rollout.kept_sizes is None else rollout.kept_sizes[valid],
        kept_ids=None if rollout.kept_ids is None else _nuclei_at(rollout, valid),
        entropy=entropy,
        ref_log_probs=ref_full,
        anchor_log_probs=anchor_full,
        divergence=None if anchor_full is None else config.divergence_fn,
        return_log_probs=return_log_probs,
        chunk_size=options.chunk_size,
    )

    def spread(values):  # [n, ...] at the valid positions -> [N, T, ...], 0 elsewhere
        if values is None:
            return None
        out = values.new_zeros((*valid.shape, *values.shape[1:]))
        return out.index_put((valid,), values)

    return PolicyOutputs(
        spread(stats.logp),
        spread(stats.topk_logp),
        spread(stats.entropy),
        spread(stats.full_estimate),
        spread(stats.kl_ref_full),
        spread(stats.log_probs),
    )
