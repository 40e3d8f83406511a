"""`token_stats`: per-token quantities of pi = softmax(z / T) computed from the final hidden states
one chunk of tokens at a time, never holding the [n, V] logits of all tokens.

The logits z = hidden @ weight.T (+ bias) of a chunk are computed in the weight's dtype, as the
model's output layer would, then cast to float32 (float64 for a float64 weight), divided by the
temperature and, for top-p rollouts, set to finfo.min outside the nucleus S_t (pi = 0 there, and
p log p stays 0 rather than NaN). From them, per token:

    logp      = log pi(a)                                 d/dz = (onehot_a - pi) / T
    topk_logp = log pi(k) at topk_ids                     d/dz = (onehot_k - pi) / T
    entropy   = H = -sum_v pi_v log pi_v                  d/dz = -pi (log pi + H) / T
    kl_ref    = KL = sum_v pi_v (log pi_v - log ref_v)     d/dz = pi (log pi - log ref - KL) / T

and, without gradient, the exact D_f(pi || anchor) of a gppo Divergence over the vocabulary (as the
`full` estimator computes it) and, on request, the whole log-distribution. Backward recomputes each
chunk's logits from the saved inputs and applies the closed forms above (masked-out entries get 0).
Autograd keeps the inputs themselves (hidden, weight, bias, the ids, ref_log_probs when given) and
[n] vectors (each row's max and log-normaliser, its entropy and KL), so the memory beyond the
inputs is O(chunk rows x V) while a chunk is processed plus O(n x K) for the outputs; only
`log_probs`, when asked for, is [n, V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gppo.core.batch import GPPOInputError
from gppo.core.divergences import Divergence
from gppo.core.estimators import normalize_rows_

CHUNK_ELEMENTS = 1 << 24  # default rows per chunk: [rows, V] float32 logits of about this many elements


@dataclass
class TokenStats:
    """Per-token outputs of `token_stats` ([n] unless noted), float32 (float64 for a float64
    weight); None where not asked for.

    logp: log pi(a) of token_ids (differentiable).
    topk_logp [n, K]: log pi at topk_ids (differentiable).
    entropy: -sum_v pi_v log pi_v (differentiable).
    kl_ref_full: KL(pi || ref) = sum_v pi_v (log pi_v - log ref_v) (differentiable).
    full_estimate: D_f(pi || anchor) over the vocabulary (no gradient).
    log_probs [n, V]: log pi (no gradient): an [n, V] output, the caller's memory cost.
    """

    logp: torch.Tensor
    topk_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    kl_ref_full: torch.Tensor | None = None
    full_estimate: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    topk_ids: torch.Tensor | None = None,
    kept_sizes: torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    entropy: bool = False,
    ref_log_probs: torch.Tensor | None = None,
    anchor_log_probs: torch.Tensor | None = None,
    divergence: Divergence | None = None,
    return_log_probs: bool = False,
    chunk_size: int | None = None,
) -> TokenStats:
    """Per-token statistics of pi = softmax((hidden @ weight.T + bias) / temperature) (module doc).

    hidden [n, H] (cast to the weight's dtype per chunk; may require grad), weight [V, H] the
    output layer's weight, bias [V] or None (cast to the weight's dtype). token_ids [n] long:
    the ids whose log pi is `logp`. topk_ids [n, K] long (duplicates allowed): `topk_logp`.
    kept_sizes [n] long and kept_ids (the kept ids of all rows concatenated in row order): the
    top-p nucleus of each row, pi = 0 outside it (size 0 at padding). entropy=True: `entropy`.
    ref_log_probs [n, V]: the reference's log-distribution, `kl_ref_full`. anchor_log_probs [n, V]
    with `divergence`: `full_estimate`, both rows normalised, `divergence.full_divergence`.
    return_log_probs: `log_probs`. temperature <= 0 means 1. chunk_size: rows per chunk (default:
    [rows, V] logits of about 2**24 elements). ref_log_probs and anchor_log_probs get no gradient.
    """
    vocab = _check_inputs(
        hidden, weight, token_ids, bias, topk_ids, kept_sizes, kept_ids, ref_log_probs, anchor_log_probs, divergence
    )
    rows = _chunk_rows(chunk_size, vocab)
    temperature = _check_temperature(temperature)
    outputs = _TokenStatsFunction.apply(
        hidden,
        weight,
        bias,
        token_ids,
        topk_ids,
        kept_sizes,
        kept_ids,
        ref_log_probs,
        anchor_log_probs,
        divergence,
        bool(entropy),
        bool(return_log_probs),
        temperature,
        rows,
    )
    return TokenStats(*outputs)


def _plan(n: int, rows: int, kept_sizes):
    """(bounds, kept_offsets): each chunk's [start, end) rows and, with a nucleus, the [first,
    last) range of its ids in kept_ids (one host sync), else None."""
    bounds = [(start, min(start + rows, n)) for start in range(0, n, rows)]
    if kept_sizes is None:
        return bounds, None
    ends = torch.tensor([end - 1 for _, end in bounds], dtype=torch.long, device=kept_sizes.device)
    lasts = kept_sizes.cumsum(0).index_select(0, ends).tolist()
    return bounds, list(zip([0, *lasts[:-1]], lasts))


class _Chunks:
    """Each chunk's float32 (float64) logits, in forward and backward alike."""

    def __init__(self, weight, bias, kept_sizes, kept_ids, temperature: float, bounds, kept_offsets):
        self.weight, self.kept_sizes, self.kept_ids = weight, kept_sizes, kept_ids
        self.bias = None if bias is None else bias.to(weight.dtype)
        self.dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.temperature, self.bounds, self.kept_offsets = temperature, bounds, kept_offsets

    def logits(self, hidden, index: int):
        """(h, z, dropped): the chunk's hidden rows in the weight's dtype, its logits z / T in the
        working dtype with finfo.min outside the nucleus, and the [rows, V] bool mask of those
        entries (None without a nucleus)."""
        start, end = self.bounds[index]
        h = hidden[start:end].to(self.weight.dtype)
        with torch.autocast(h.device.type, enabled=False):  # the weight's dtype, also under autocast
            z = F.linear(h, self.weight, self.bias).to(self.dtype).div_(self.temperature)
        if self.kept_sizes is None:
            return h, z, None
        first, last = self.kept_offsets[index]
        row = torch.repeat_interleave(
            torch.arange(end - start, device=z.device), self.kept_sizes[start:end], output_size=last - first
        )
        dropped = torch.ones(z.shape, dtype=torch.bool, device=z.device)
        dropped[row, self.kept_ids[first:last]] = False
        return h, z.masked_fill_(dropped, torch.finfo(self.dtype).min), dropped


class _TokenStatsFunction(torch.autograd.Function):
    """Forward chunk by chunk; backward recomputes each chunk's logits (module doc)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        token_ids,
        topk_ids,
        kept_sizes,
        kept_ids,
        ref_log_probs,
        anchor_log_probs,
        divergence,
        want_entropy,
        want_log_probs,
        temperature,
        rows,
    ):
        plan = _plan(hidden.shape[0], rows, kept_sizes)
        chunks = _Chunks(weight, bias, kept_sizes, kept_ids, temperature, *plan)
        n, dtype, device = hidden.shape[0], chunks.dtype, hidden.device

        def per_row(wanted: bool, *shape):
            return torch.empty(n, *shape, dtype=dtype, device=device) if wanted else None

        logp = per_row(True)
        topk_logp = None if topk_ids is None else per_row(True, topk_ids.shape[1])
        entropy, kl = per_row(want_entropy), per_row(ref_log_probs is not None)
        estimate = per_row(divergence is not None)
        log_probs = per_row(want_log_probs, weight.shape[0])
        shift, log_norm = per_row(True), per_row(True)  # log pi = (z - shift) - log_norm
        for index, (start, end) in enumerate(chunks.bounds):
            _, z, _ = chunks.logits(hidden, index)
            # log-softmax as normalize_rows_: (z - max) - log sum exp(z - max)
            top = z.amax(-1, keepdim=True)
            z -= top
            weights = z.exp()
            norm = weights.sum(-1, keepdim=True)
            log_s = norm.log()
            shift[start:end], log_norm[start:end] = top.squeeze(-1), log_s.squeeze(-1)
            logp[start:end] = (z.gather(1, token_ids[start:end, None]) - log_s).squeeze(-1)
            if topk_logp is not None:
                topk_logp[start:end] = z.gather(1, topk_ids[start:end]) - log_s
            if entropy is not None:  # log S - sum e^d d / S, d = z - max (finfo.min cells: e^d = 0)
                entropy[start:end] = (log_s - (weights * z).sum(-1, keepdim=True) / norm).squeeze(-1)
            if kl is None and estimate is None and log_probs is None:
                continue
            log_pi = z.sub_(log_s)
            if log_probs is not None:
                log_probs[start:end] = log_pi
            if kl is not None:
                kl[start:end] = _kl_cells(log_pi, log_pi.exp(), ref_log_probs[start:end]).sum(-1)
            if estimate is not None:  # as estimators._full_chunk; normalize_rows_ works in place
                log_mu = normalize_rows_(anchor_log_probs[start:end].to(dtype, copy=True))
                estimate[start:end] = divergence.full_divergence(log_pi, log_mu)

        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(x for x in (estimate, log_probs) if x is not None))
        ctx.plan, ctx.temperature = plan, temperature
        ctx.save_for_backward(
            hidden, weight, bias, token_ids, topk_ids, kept_sizes, kept_ids, ref_log_probs, shift, log_norm, entropy, kl
        )
        return logp, topk_logp, entropy, kl, estimate, log_probs

    @staticmethod
    def backward(ctx, g_logp, g_topk, g_entropy, g_kl, _g_estimate, _g_log_probs):
        (
            hidden,
            weight,
            bias,
            token_ids,
            topk_ids,
            kept_sizes,
            kept_ids,
            ref_log_probs,
            shift,
            log_norm,
            entropy,
            kl,
        ) = ctx.saved_tensors
        chunks = _Chunks(weight, bias, kept_sizes, kept_ids, ctx.temperature, *ctx.plan)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # parameter gradients are summed over chunks in float32 (float64), cast at the end
        accumulator = dict(dtype=chunks.dtype, device=weight.device)
        grad_weight = torch.zeros(weight.shape, **accumulator) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], **accumulator) if need_bias else None
        # g = pi * (c + a log pi + b (log pi - log ref)) + the one-hot terms, per row:
        # c = -(g_logp + sum_k g_topk + g_H H + g_KL KL), a = -g_H, b = g_KL
        c = torch.zeros_like(shift)
        if g_logp is not None:
            c -= g_logp
        if g_topk is not None:
            c -= g_topk.sum(-1)
        if g_entropy is not None:
            c -= g_entropy * entropy
        if g_kl is not None:
            c -= g_kl * kl
        for index, (start, end) in enumerate(chunks.bounds):
            h, z, dropped = chunks.logits(hidden, index)
            log_pi = z.sub_(shift[start:end, None]).sub_(log_norm[start:end, None])
            pi = log_pi.exp()
            g = pi * c[start:end, None]
            if g_entropy is not None:  # pi log pi is 0 where pi = 0 (log pi = finfo.min)
                g -= g_entropy[start:end, None] * (pi * log_pi)
            if g_kl is not None:
                g += g_kl[start:end, None] * _kl_cells(log_pi, pi, ref_log_probs[start:end])
            if g_logp is not None:
                g.scatter_add_(1, token_ids[start:end, None], g_logp[start:end, None])
            if g_topk is not None:
                g.scatter_add_(1, topk_ids[start:end], g_topk[start:end])
            if dropped is not None:
                g.masked_fill_(dropped, 0.0)
            g_low = g.div_(chunks.temperature).to(weight.dtype)  # the gradient wrt the chunk's logits
            if need_hidden:
                grad_hidden[start:end] = g_low @ weight
            if need_weight and grad_weight.dtype == weight.dtype:
                grad_weight.addmm_(g_low.T, h)
            elif need_weight:
                grad_weight += g_low.T @ h
            if need_bias:
                grad_bias += g_low.sum(0, dtype=grad_bias.dtype)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *([None] * 11),
        )


def _kl_cells(log_pi: torch.Tensor, pi: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """pi (log pi - log ref): the KL(pi || ref) cells, 0 where pi = 0 (a masked column, where
    log ref may be -inf); log ref is read in log pi's dtype."""
    return pi * torch.where(pi > 0, log_pi - log_ref.to(log_pi.dtype), 0.0)


def _chunk_rows(chunk_size, vocab: int) -> int:
    if chunk_size is None:
        return max(1, CHUNK_ELEMENTS // vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise GPPOInputError(
            f"token_stats: chunk_size must be an integer >= 1 (rows per chunk), got "
            f"{chunk_size!r}; pass e.g. chunk_size=128, or None for the default"
        )
    return chunk_size


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise GPPOInputError(f"token_stats: temperature must be a finite number (<= 0 means 1), got {temperature!r}")
    return float(temperature) if temperature > 0 else 1.0


def _check_inputs(
    hidden, weight, token_ids, bias, topk_ids, kept_sizes, kept_ids, ref_log_probs, anchor_log_probs, divergence
) -> int:
    """Raise a GPPOInputError naming the first bad argument, the shape got and the one expected;
    returns V."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        _check_tensor(name, x, 2, float_=True)
    n, (vocab, width) = hidden.shape[0], weight.shape
    if hidden.device != weight.device:
        raise GPPOInputError(
            f"token_stats: hidden is on {hidden.device}, weight on {weight.device}; move all inputs to one device"
        )
    if hidden.shape[1] != width:
        raise GPPOInputError(
            f"token_stats: hidden must be [n, H] with H = weight.shape[1] = {width}, "
            f"got {list(hidden.shape)} (weight {list(weight.shape)} is [V, H])"
        )
    expected = {
        "bias": ([vocab], True),
        "token_ids": ([n], False),
        "topk_ids": ([n, None], False),
        "kept_sizes": ([n], False),
        "kept_ids": ([None], False),
        "ref_log_probs": ([n, vocab], True),
        "anchor_log_probs": ([n, vocab], True),
    }
    given = {
        "bias": bias,
        "token_ids": token_ids,
        "topk_ids": topk_ids,
        "kept_sizes": kept_sizes,
        "kept_ids": kept_ids,
        "ref_log_probs": ref_log_probs,
        "anchor_log_probs": anchor_log_probs,
    }
    for name, x in given.items():
        if x is None:
            continue
        shape, float_ = expected[name]
        _check_tensor(name, x, len(shape), float_)
        if any(want is not None and got != want for got, want in zip(x.shape, shape)):
            want = ", ".join("K" if s is None and name == "topk_ids" else str(s) for s in shape)
            raise GPPOInputError(
                f"token_stats: {name} must be [{want}] (n = hidden.shape[0], V = weight.shape[0]), got {list(x.shape)}"
            )
        if x.device != weight.device:
            raise GPPOInputError(
                f"token_stats: {name} is on {x.device}, weight on {weight.device}; move all inputs to one device"
            )
    for name in ("token_ids", "topk_ids", "kept_ids"):
        ids = given[name]
        if ids is not None and ids.numel():
            low, high = torch.stack(torch.aminmax(ids)).tolist()
            if low < 0 or high >= vocab:
                raise GPPOInputError(f"token_stats: {name} must lie in [0, V = {vocab}), got values in [{low}, {high}]")
    if (kept_sizes is None) != (kept_ids is None):
        raise GPPOInputError("token_stats: kept_sizes and kept_ids describe the nucleus together; pass both or neither")
    if kept_sizes is not None:
        total, low = torch.stack([kept_sizes.sum(), kept_sizes.min()]).tolist() if kept_sizes.numel() else (0, 0)
        if low < 0 or total != kept_ids.numel():
            raise GPPOInputError(
                f"token_stats: kept_sizes must be >= 0 and sum to len(kept_ids) = "
                f"{kept_ids.numel()}, got sum {total} (min {low})"
            )
    if (anchor_log_probs is None) != (divergence is None):
        raise GPPOInputError(
            "token_stats: full_estimate needs anchor_log_probs and divergence together; pass both or neither"
        )
    if divergence is not None and not isinstance(divergence, Divergence):
        raise GPPOInputError(
            f"token_stats: divergence must be a gppo Divergence (e.g. "
            f"gppo.divergence('kl')), got {type(divergence).__name__}"
        )
    return vocab


def _check_tensor(name: str, x, dims: int, float_: bool) -> None:
    kind = "floating-point" if float_ else "long integer"
    if not isinstance(x, torch.Tensor):
        raise GPPOInputError(f"token_stats: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise GPPOInputError(f"token_stats: {name} must have {dims} dimension(s), got shape {list(x.shape)}")
    if x.is_floating_point() != float_ or (not float_ and x.dtype != torch.long):
        raise GPPOInputError(f"token_stats: {name} must be a {kind} tensor, got {x.dtype}")
