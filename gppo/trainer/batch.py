"""Rollouts as tensors, and the training forward pass that turns them into a `gppo.TokenBatch`.

Layout of a rollout of N sequences: prompts left-padded to P tokens, completions right-padded to
T tokens, so that `input_ids` is [N, P + T] and the logits that predict completion token t sit at
position P - 1 + t. Log-probs are log_softmax(logits / temperature), exactly as in the rollout;
they are computed from the hidden states at the completion positions alone, one chunk of tokens at
a time (`gppo.token_stats`), so the training forward never holds [N, T, V] logits.

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
from dataclasses import dataclass, fields, replace

import torch
from transformers import DynamicCache

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
    logp_old_full: torch.Tensor | None = None  # [N, T, V]: estimator 'full' with anchor='old'
    logp_behavior_full: torch.Tensor | None = None  # [N, T, V]
    logp_ref: torch.Tensor | None = None
    logp_ref_full: torch.Tensor | None = None
    kept_sizes: torch.Tensor | None = None  # [N, T] |S_t| of top-p rollouts (0 at padding)
    kept_ids: list[torch.Tensor] | None = None  # per sequence: its S_t ids concatenated over t

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
    for i, g in enumerate(generations):
        p, t = len(g.prompt_ids), len(g.completion_ids)
        input_ids[i, P - p : P] = torch.tensor(g.prompt_ids)
        attention[i, P - p : P + t] = 1
        if t:
            input_ids[i, P : P + t] = torch.tensor(g.completion_ids)
            token_ids[i, :t] = torch.tensor(g.completion_ids)
            response_mask[i, :t] = 1
            logp[i, :t] = torch.tensor(g.logprobs)
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
    )


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


def completion_hidden_states(model, rollout: Rollout, share_prompt: bool = True) -> torch.Tensor:
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


def policy_outputs(
    model,
    rollout: Rollout,
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
    if config is not None and config.estimator is not None and "full" in gppo.ESTIMATORS[config.estimator].anchor:
        anchor_full = rollout.logp_behavior_full if config.anchor == "behavior" else rollout.logp_old_full
    if config is not None and config.kl_estimator == "full" and rollout.logp_ref_full is not None:
        ref_full = rollout.logp_ref_full[valid]
    stats = gppo.token_stats(
        hidden,
        weight,
        rollout.token_ids[valid],
        bias=bias,
        temperature=temperature,
        topk_ids=None if rollout.topk_ids is None else rollout.topk_ids[valid],
        kept_sizes=None if rollout.kept_sizes is None else rollout.kept_sizes[valid],
        kept_ids=None if rollout.kept_ids is None else torch.cat(rollout.kept_ids).to(hidden.device),
        entropy=entropy,
        ref_log_probs=ref_full,
        anchor_log_probs=None if anchor_full is None else anchor_full[valid],
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
