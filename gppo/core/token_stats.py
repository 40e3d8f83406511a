"""`token_stats`: per-token quantities of pi = softmax(z / T), one chunk of tokens at a time, from
the final hidden states (z = hidden @ weight.T + bias: never holding the [n, V] logits of all
tokens) or from given logits (`logits_stats`). The vocabulary kernel: every pass of gppo over the
whole vocabulary (the training forward, the TRL and verl top-K passes, the `full` estimator, the
exact reference KL, the entropy metric) runs here, on the row formulas of `gppo.core.vocab`.

Each chunk's logits are computed in the weight's dtype, as the model's output layer would (or read
from the given logits), then cast to float32 (float64 for float64 inputs), divided by the
temperature and, for top-p rollouts, set to finfo.min outside the nucleus S_t (pi = 0 there, and
p log p stays 0 rather than NaN; a given logit may be -inf). Per token:

    logp      = log pi(a)                                 d/dz = (onehot_a - pi) / T
    topk_logp = log pi(k) at topk_ids                     d/dz = (onehot_k - pi) / T
    entropy   = H = -sum_v pi_v log pi_v                  d/dz = -pi (log pi + H) / T
    kl_ref    = KL = sum_v pi_v (log pi_v - log ref_v)     d/dz = pi (log pi - log ref - KL) / T

and, without gradient, the exact D_f(pi || anchor) of a gppo Divergence over the vocabulary,
pi's own K most probable tokens and, on request, the whole log-distribution. Backward recomputes
each chunk's logits from the saved inputs and applies the closed forms above (masked-out entries
get 0). The gradient wrt a chunk's logits is rounded to the weight's dtype, as autograd of the
full logits rounds it, and the weight and bias gradients are summed over chunks in float32
(float64), each chunk's product included (a bfloat16 product per chunk would round each part
before the sum and bias the gradient): with a bfloat16 head every gradient is the full-logits
computation's up to float32 summation order, draw by draw, hence as accurate. Autograd keeps
the inputs themselves and [n] vectors (each row's max and log-normaliser, its entropy and KL), so
the memory beyond the inputs is O(chunk rows x V) while a chunk is processed plus O(n x K) for the
outputs; only `log_probs`, when asked for, is [n, V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gppo.core import vocab
from gppo.core.batch import GPPOInputError
from gppo.core.divergences import Divergence

CHUNK_ELEMENTS = 1 << 24  # default rows per chunk: [rows, V] float32 logits of about this many elements


@dataclass
class TokenStats:
    """Per-token outputs of `token_stats` / `logits_stats` (the module doc's table: the first four
    are differentiable), [n] unless noted, float32 (float64 for float64 inputs), None where not
    asked for: topk_logp [n, K] at topk_ids; log_probs [n, V] (the caller's memory cost);
    pi_topk_logp and pi_topk_ids [n, K], pi's own K most probable tokens, descending."""

    logp: torch.Tensor | None
    topk_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    kl_ref_full: torch.Tensor | None = None
    full_estimate: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    pi_topk_logp: torch.Tensor | None = None
    pi_topk_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenStatsOptions:
    """What a pass computes beyond the per-row inputs it is given, and how it chunks.

    temperature: z / T (> 0). entropy / return_log_probs: those outputs. top_k: pi's own top-K
    (0: none). divergence: of `full_estimate` (with anchor_log_probs). chunk_rows: rows per chunk."""

    temperature: float = 1.0
    entropy: bool = False
    return_log_probs: bool = False
    top_k: int = 0
    divergence: Divergence | None = None
    chunk_rows: int = 1


@dataclass(frozen=True)
class RowInputs:
    """The per-row tensors of a pass that get no gradient, each indexed by row (by `rows[i]` when
    given: a pass over some rows of larger tensors, without copying them)."""

    token_ids: torch.Tensor | None = None  # [n] long
    topk_ids: torch.Tensor | None = None  # [n, K] long
    kept_sizes: torch.Tensor | None = None  # [n] long, with kept_ids: the nucleus of each row
    kept_ids: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None  # [n, V]
    anchor_log_probs: torch.Tensor | None = None  # [n, V]
    rows: torch.Tensor | None = None  # [m] long


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
    top_k: int = 0,
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
    return_log_probs: `log_probs`. top_k: `pi_topk_logp` / `pi_topk_ids`. temperature <= 0 means 1.
    chunk_size: rows per chunk (default: [rows, V] logits of about 2**24 elements). ref_log_probs
    and anchor_log_probs get no gradient.
    """
    n, vocab_size = _check_hidden(hidden, weight)
    inputs = RowInputs(token_ids, topk_ids, kept_sizes, kept_ids, ref_log_probs, anchor_log_probs)
    options = _options(inputs, n, vocab_size, weight.device, bias, temperature, entropy, return_log_probs, top_k,
                       divergence, chunk_size)  # fmt: skip
    return TokenStats(*_VocabularyPass.apply(hidden, weight, bias, inputs, options))


def logits_stats(
    logits: torch.Tensor,
    token_ids: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    topk_ids: torch.Tensor | None = None,
    entropy: bool = False,
    ref_log_probs: torch.Tensor | None = None,
    anchor_log_probs: torch.Tensor | None = None,
    divergence: Divergence | None = None,
    return_log_probs: bool = False,
    top_k: int = 0,
    chunk_size: int | None = None,
) -> TokenStats:
    """`token_stats` of given logits [n, V] (z; differentiable): the same outputs from the same row
    formulas, for callers that hold the logits already (verl's engine, a TokenBatch with `logits`).
    token_ids is optional here (`logp` None without it). No nucleus: pass -inf outside it.

    mask [B, T] (any leading shape) with logits [B, T, V] (and per-row inputs [B, T, ...]): only the
    positions where it is set are computed, without copying any [B, T, V] tensor; each output is
    [B, T, ...], 0 elsewhere."""
    kwargs = dict(
        token_ids=token_ids, topk_ids=topk_ids, ref_log_probs=ref_log_probs, anchor_log_probs=anchor_log_probs
    )
    rows = None
    if mask is not None:
        rows = mask.reshape(-1).bool().nonzero().squeeze(-1)
        kwargs = {
            name: None if x is None else x.reshape(mask.numel(), *x.shape[mask.dim() :]) for name, x in kwargs.items()
        }
        logits = logits.reshape(mask.numel(), *logits.shape[mask.dim() :])
    _check_tensor("logits", logits, 2, float_=True)
    inputs = RowInputs(**kwargs, rows=rows)
    options = _options(inputs, *logits.shape, logits.device, None, temperature, entropy, return_log_probs, top_k,
                       divergence, chunk_size, where="(n = logits.shape[0], V = logits.shape[1])")  # fmt: skip
    stats = TokenStats(*_VocabularyPass.apply(logits, None, None, inputs, options))
    if mask is None:
        return stats

    def spread(values):  # [rows, ...] -> [B, T, ...], 0 outside the mask
        out = values.new_zeros((mask.numel(), *values.shape[1:]))
        return out.index_copy(0, rows, values).view(*mask.shape, *values.shape[1:])

    return TokenStats(*(None if x is None else spread(x) for x in vars(stats).values()))


def _options(inputs: RowInputs, n, vocab_size, device, bias, temperature, entropy, return_log_probs, top_k,
             divergence, chunk_size, where="(n = hidden.shape[0], V = weight.shape[0])") -> TokenStatsOptions:  # fmt: skip
    """The validated options of a pass (every argument checked, named in the error)."""
    _check_inputs(n, vocab_size, device, inputs, bias, divergence, where)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab_size:
        raise GPPOInputError(f"token_stats: top_k must be an integer in [0, V = {vocab_size}], got {top_k!r}")
    return TokenStatsOptions(
        temperature=_check_temperature(temperature),
        entropy=bool(entropy),
        return_log_probs=bool(return_log_probs),
        top_k=top_k,
        divergence=divergence,
        chunk_rows=_chunk_rows(chunk_size, vocab_size),
    )


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
    """Each chunk's rows and float32 (float64) logits, in forward and backward alike: from hidden
    states and the output layer (weight given), or read from given logits (weight None)."""

    def __init__(self, source, weight, bias, inputs: RowInputs, temperature: float):
        self.source, self.weight, self.inputs, self.temperature = source, weight, inputs, temperature
        self.bias = None if bias is None or weight is None else bias.to(weight.dtype)
        lead = source if weight is None else weight
        self.dtype = torch.float64 if lead.dtype == torch.float64 else torch.float32
        self.n = source.shape[0] if inputs.rows is None else inputs.rows.shape[0]

    def plan(self, chunk_rows: int):
        self.bounds, self.kept_offsets = _plan(self.n, chunk_rows, self.inputs.kept_sizes)
        return self

    def row(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """The chunk's rows of a per-row input."""
        start, end = self.bounds[index]
        rows = self.inputs.rows
        return x[start:end] if rows is None else x.index_select(0, rows[start:end])

    def logits(self, index: int):
        """(h, z, dropped): the chunk's hidden rows in the weight's dtype (None for given logits),
        its logits z / T in the working dtype with finfo.min outside the nucleus, and the
        [rows, V] bool mask of those entries (None without a nucleus)."""
        if self.weight is None:
            z = self.row(self.source, index).to(self.dtype, copy=True)
            return None, z.div_(self.temperature), None
        h = self.row(self.source, index).to(self.weight.dtype)
        with torch.autocast(h.device.type, enabled=False):  # the weight's dtype, also under autocast
            z = F.linear(h, self.weight, self.bias).to(self.dtype).div_(self.temperature)
        if self.inputs.kept_sizes is None:
            return h, z, None
        start, end = self.bounds[index]
        first, last = self.kept_offsets[index]
        row = torch.repeat_interleave(
            torch.arange(end - start, device=z.device), self.inputs.kept_sizes[start:end], output_size=last - first
        )
        dropped = torch.ones(z.shape, dtype=torch.bool, device=z.device)
        dropped[row, self.inputs.kept_ids[first:last]] = False
        return h, z.masked_fill_(dropped, torch.finfo(self.dtype).min), dropped


class _VocabularyPass(torch.autograd.Function):
    """Forward chunk by chunk; backward recomputes each chunk's logits (module doc). Gradients
    reach the source (hidden states or logits), the weight and the bias."""

    @staticmethod
    def forward(ctx, source, weight, bias, inputs: RowInputs, options: TokenStatsOptions):
        chunks = _Chunks(source, weight, bias, inputs, options.temperature).plan(options.chunk_rows)
        n, dtype, device = chunks.n, chunks.dtype, source.device
        vocab_size = source.shape[1] if weight is None else weight.shape[0]

        def per_row(wanted, *shape, dtype=dtype):
            return torch.empty(n, *shape, dtype=dtype, device=device) if wanted else None

        logp = per_row(inputs.token_ids is not None)
        topk_logp = None if inputs.topk_ids is None else per_row(True, inputs.topk_ids.shape[1])
        entropy, kl = per_row(options.entropy), per_row(inputs.ref_log_probs is not None)
        estimate = per_row(options.divergence is not None)
        log_probs = per_row(options.return_log_probs, vocab_size)
        pi_topk_logp = per_row(options.top_k > 0, options.top_k)
        pi_topk_ids = per_row(options.top_k > 0, options.top_k, dtype=torch.long)
        shift, log_norm = per_row(True), per_row(True)  # log pi = (z - shift) - log_norm
        for index, (start, end) in enumerate(chunks.bounds):
            _, z, _ = chunks.logits(index)
            top = z.amax(-1, keepdim=True)
            weights = z.sub_(top).exp()
            norm = weights.sum(-1, keepdim=True)
            log_s = norm.log()
            shift[start:end], log_norm[start:end] = top.squeeze(-1), log_s.squeeze(-1)
            log_pi = z.sub_(log_s)  # vocab.log_normalize_, keeping the max and the normaliser
            if logp is not None:
                logp[start:end] = log_pi.gather(1, chunks.row(inputs.token_ids, index)[:, None]).squeeze(-1)
            if topk_logp is not None:
                topk_logp[start:end] = log_pi.gather(1, chunks.row(inputs.topk_ids, index))
            if pi_topk_logp is not None:
                pi_topk_logp[start:end], pi_topk_ids[start:end] = log_pi.topk(options.top_k, dim=-1)
            if log_probs is not None:
                log_probs[start:end] = log_pi
            if entropy is not None or kl is not None:
                pi = weights.div_(norm)
                if entropy is not None:
                    entropy[start:end] = vocab.entropy(log_pi, pi)
                if kl is not None:
                    kl[start:end] = vocab.kl_cells(log_pi, pi, chunks.row(inputs.ref_log_probs, index)).sum(-1)
            if estimate is not None:
                anchor = chunks.row(inputs.anchor_log_probs, index)
                estimate[start:end] = vocab.exact_divergence(options.divergence, log_pi, anchor)

        ctx.set_materialize_grads(False)
        no_gradient = (estimate, log_probs, pi_topk_logp, pi_topk_ids)
        ctx.mark_non_differentiable(*(x for x in no_gradient if x is not None))
        ctx.options = options
        backward_inputs = (inputs.token_ids, inputs.topk_ids, inputs.kept_sizes, inputs.kept_ids)
        backward_inputs += (inputs.ref_log_probs, inputs.rows)
        ctx.save_for_backward(source, weight, bias, shift, log_norm, entropy, kl, *backward_inputs)
        return logp, topk_logp, entropy, kl, estimate, log_probs, pi_topk_logp, pi_topk_ids

    @staticmethod
    def backward(ctx, g_logp, g_topk, g_entropy, g_kl, *_no_gradient):
        source, weight, bias, shift, log_norm, entropy, kl, *backward_inputs = ctx.saved_tensors
        token_ids, topk_ids, kept_sizes, kept_ids, ref_log_probs, rows = backward_inputs
        inputs = RowInputs(token_ids, topk_ids, kept_sizes, kept_ids, ref_log_probs, rows=rows)
        options = ctx.options
        chunks = _Chunks(source, weight, bias, inputs, options.temperature).plan(options.chunk_rows)
        need_source, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_source = None
        if need_source:  # rows not computed (given logits outside `rows`) get 0
            grad_source = torch.zeros_like(source) if inputs.rows is not None else torch.empty_like(source)
        # parameter gradients are summed over chunks in float32 (float64), cast at the end
        accumulator = dict(dtype=chunks.dtype, device=source.device)
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
            h, z, dropped = chunks.logits(index)
            log_pi = z.sub_(shift[start:end, None]).sub_(log_norm[start:end, None])
            pi = log_pi.exp()
            g = pi * c[start:end, None]
            if g_entropy is not None:
                g -= g_entropy[start:end, None] * vocab.plogp(log_pi, pi)
            if g_kl is not None:
                g += g_kl[start:end, None] * vocab.kl_cells(log_pi, pi, chunks.row(inputs.ref_log_probs, index))
            if g_logp is not None:
                g.scatter_add_(1, chunks.row(inputs.token_ids, index)[:, None], g_logp[start:end, None])
            if g_topk is not None:
                g.scatter_add_(1, chunks.row(inputs.topk_ids, index), g_topk[start:end])
            if dropped is not None:
                g.masked_fill_(dropped, 0.0)
            g.div_(options.temperature)  # the gradient wrt the chunk's logits
            if weight is None:
                if need_source and inputs.rows is None:
                    grad_source[start:end] = g
                elif need_source:
                    grad_source.index_copy_(0, inputs.rows[start:end], g.to(source.dtype))
                continue
            if g.dtype != weight.dtype:  # rounded to the weight's dtype, as autograd of the full logits rounds it
                g.copy_(g.to(weight.dtype))
            if need_source:
                grad_source[start:end] = g.to(weight.dtype) @ weight
            if need_weight:  # the chunk's product summed in float32 (float64), not rounded to bfloat16 first
                grad_weight.addmm_(g.T, h.to(g.dtype))
            if need_bias:
                grad_bias += g.sum(0)
        return (
            grad_source,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def _chunk_rows(chunk_size, vocab_size: int) -> int:
    if chunk_size is None:
        return max(1, CHUNK_ELEMENTS // vocab_size)
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


def _check_hidden(hidden, weight) -> tuple[int, int]:
    """(n, V) of token_stats' hidden [n, H] and weight [V, H], or a GPPOInputError."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        _check_tensor(name, x, 2, float_=True)
    (vocab, width) = weight.shape
    if hidden.device != weight.device:
        raise GPPOInputError(
            f"token_stats: hidden is on {hidden.device}, weight on {weight.device}; move all inputs to one device"
        )
    if hidden.shape[1] != width:
        raise GPPOInputError(
            f"token_stats: hidden must be [n, H] with H = weight.shape[1] = {width}, "
            f"got {list(hidden.shape)} (weight {list(weight.shape)} is [V, H])"
        )
    return hidden.shape[0], vocab


def _check_inputs(n, vocab, device, inputs: RowInputs, bias, divergence, where) -> None:
    """Raise a GPPOInputError naming the first bad per-row argument, the shape got and the one
    expected (n rows, V columns, all on `device`)."""
    expected = {
        "bias": ([vocab], True),
        "token_ids": ([n], False),
        "topk_ids": ([n, None], False),
        "kept_sizes": ([n], False),
        "kept_ids": ([None], False),
        "ref_log_probs": ([n, vocab], True),
        "anchor_log_probs": ([n, vocab], True),
    }
    given = {"bias": bias, **{name: getattr(inputs, name) for name in expected if name != "bias"}}
    kept_sizes, kept_ids, anchor_log_probs = inputs.kept_sizes, inputs.kept_ids, inputs.anchor_log_probs
    for name, x in given.items():
        if x is None:
            continue
        shape, float_ = expected[name]
        _check_tensor(name, x, len(shape), float_)
        if any(want is not None and got != want for got, want in zip(x.shape, shape)):
            want = ", ".join("K" if s is None and name == "topk_ids" else str(s) for s in shape)
            raise GPPOInputError(f"token_stats: {name} must be [{want}] {where}, got {list(x.shape)}")
        if x.device != device:
            raise GPPOInputError(
                f"token_stats: {name} is on {x.device}, the logits on {device}; move all inputs to one device"
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


def _check_tensor(name: str, x, dims: int, float_: bool) -> None:
    kind = "floating-point" if float_ else "long integer"
    if not isinstance(x, torch.Tensor):
        raise GPPOInputError(f"token_stats: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise GPPOInputError(f"token_stats: {name} must have {dims} dimension(s), got shape {list(x.shape)}")
    if x.is_floating_point() != float_ or (not float_ and x.dtype != torch.long):
        raise GPPOInputError(f"token_stats: {name} must be a {kind} tensor, got {x.dtype}")
