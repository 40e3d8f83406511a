"""`HFEngine`: sampling with any transformers causal LM through a hand-written KV-cache loop.

The loop sees every step's logits, so the behaviour policy's log-probs (and top-K) are recorded
from exactly the distribution that was sampled: log_softmax(logits / T), truncated to the top-p
nucleus S and renormalised when `top_p < 1` (top-K entries outside S then read -inf; with
`record_kept_ids` the engine also returns S). Greedy decoding (`temperature == 0`) records
log-probs at T = 1 and ignores `top_p`.

Prompts are tokenized as the tokenizer does by default (with a BOS where it adds one) and
left-padded with matching `attention_mask` and `position_ids`. Each distinct prompt of a batch is
prefilled once and its KV cache copied to the rows of its group (`n` completions per prompt), so a
group of 8 costs one prompt forward, not 8. A sequence leaves the batch (and the cache) as soon as
it emits an EOS token. The EOS token is kept as the last entry of `completion_ids`/`logprobs`
(the trainer must learn to stop) but not in `text`.

Continuous batching (`stream`): groups join the running batch between two decoding steps. Their
prompts are prefilled apart and their KV cache placed beside the running rows', right-aligned at
the current position with the positions before it masked, so the running rows are not recomputed;
leading positions masked in every row are dropped once they are half the cache's width. (A model
whose cache is not one buffer per layer, e.g. with sliding-window layers, recomputes every row's
cache from its ids instead, as after a change of weights.)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gppo.core import log_normalize_
from gppo.rollout.base import Generation, GroupRequest, SamplingParams, check_row_seeds


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS and every EOS id of the model's generation_config (instruct models
    often have several, e.g. <|im_end|> and <|endoftext|>)."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = extra if isinstance(extra, (list, tuple)) else [extra]
    return sorted({tokenizer.eos_token_id, *(e for e in extra if e is not None)})


class HFEngine:
    """Sample `n` completions per prompt, `batch_size` sequences at a time.

    `device=None` keeps the model where it is. A sequence stops at any id of `eos_token_ids`.
    """

    def __init__(self, model, tokenizer, device: str | torch.device | None = None, batch_size: int = 256):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no EOS token, so generation could never stop: set "
                "tokenizer.eos_token (gppo.models.loading.load_tokenizer checks this on load)"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model, self.tokenizer, self.batch_size = model.to(self.device), tokenizer, batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = torch.tensor(eos_token_ids(model, tokenizer), device=self.device)
        self.max_top_k_logprobs = model.get_output_embeddings().weight.shape[0]
        self.separate_weights = False  # mu is `model` itself, or the trainer's copy (RolloutPolicy)
        unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
        params = inspect.signature(unwrapped.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._fence_ids: torch.Tensor | None = None  # tokens whose text holds a backtick or a newline

    def update_weights(self, model) -> None:
        """Nothing to load: the engine samples from the model it holds (the trainer refreshes its
        copy of the weights, if any, itself)."""

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt, grouped by prompt in prompt order. The draws
        come from one random stream (`seed`), or one per completion (`row_seeds`)."""
        self._check(params)
        encoded = encode(self.tokenizer, prompts)
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("a prompt is empty after tokenization; every prompt needs at least one token")
        check_row_seeds(params, len(encoded))
        rows = [
            _Row(index, prompt, ids, None if params.row_seeds is None else self._generator(params.row_seeds[index]))
            for index, (prompt, ids) in enumerate((i, ids) for i, ids in enumerate(encoded) for _ in range(params.n))
        ]
        shared = None
        if params.row_seeds is None:  # one stream for the batch
            shared = torch.Generator(self.device)
            if params.seed is None:
                shared.seed()
            else:
                shared.manual_seed(params.seed)
        out: list[Generation | None] = [None] * len(rows)

        def keep(row: _Row, generation: Generation) -> None:
            out[row.index] = generation

        with self._evaluating():
            for start in range(0, len(rows), self.batch_size):  # each batch_size rows sampled together
                chunks = iter([rows[start : start + self.batch_size]])  # all of them at the first step
                self._decode(lambda room, chunks=chunks: next(chunks, []), params, keep, shared)
        return out

    def stream(self, feed: Callable[[int], Sequence[GroupRequest]], params: SamplingParams, done) -> None:
        """Continuous batching: before every decoding step `feed(groups)` may hand in up to `groups`
        new groups (as many as free rows of `batch_size` allow), which join the running batch; each
        group's `params.n` completions draw from their `row_seeds`, and `done(key, generations)` is
        called as soon as the last of them ends. Returns once no completion runs and `feed` gives
        none. With `params.policy_version` every token's version is recorded."""
        self._check(params)
        if params.stop_at_code_block:
            raise ValueError("stream samples without tool calls: stop_at_code_block needs generate")
        finished: dict[object, list[Generation | None]] = {}

        def admit(room: int) -> list[_Row]:
            rows = []
            for group in feed(room // params.n):
                if len(group.row_seeds) != params.n or not group.prompt_ids:
                    raise ValueError(f"group {group.key!r} needs a prompt and {params.n} row seeds")
                finished[group.key] = [None] * params.n
                rows += [
                    _Row(j, group.key, list(group.prompt_ids), self._generator(seed))
                    for j, seed in enumerate(group.row_seeds)
                ]
            return rows

        def keep(row: _Row, generation: Generation) -> None:
            group = finished[row.prompt]
            group[row.index] = generation
            if all(g is not None for g in group):
                done(row.prompt, finished.pop(row.prompt))

        with self._evaluating():
            self._decode(admit, params, keep, None)

    def _check(self, params: SamplingParams) -> None:
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(
                f"invalid SamplingParams {params}: need temperature >= 0, 0 < top_p <= 1, "
                "n >= 1 and max_new_tokens >= 1"
            )
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(
                f"top_k_logprobs={params.top_k_logprobs} exceeds the vocabulary size {self.max_top_k_logprobs}"
            )

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed % 2**63)

    @contextlib.contextmanager
    def _evaluating(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def _forward(self, ids, mask, positions, cache):
        return (
            self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kw: cache},
                **self._keep_last,
            )
            .logits[:, -1]
            .float()
        )

    @torch.inference_mode()
    def _decode(self, admit, params: SamplingParams, keep, shared: torch.Generator | None) -> None:
        """The decoding loop. Before each step `admit(free rows)` returns rows to start (a prompt's
        rows consecutive, their prompt prefilled once); each row draws from its own generator, or
        all from `shared`. `keep(row, generation)` gets each completion as it ends."""
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        batch = _Batch(self)
        while True:
            version = params.policy_version() if params.policy_version is not None else None
            new = admit(self.batch_size - len(batch.rows)) if len(batch.rows) < self.batch_size else []
            if not batch.rows and not new:
                return
            logits = batch.step(new, version, params.max_new_tokens)
            draws = shared if shared is not None else [row.generator for row in batch.rows]
            token, lp_token, tk_ids, tk_lps, kept = self._sample(logits, params, draws, record_kept)
            done = torch.isin(token, self.eos_ids)
            for row, t, lp in zip(batch.rows, token.tolist(), lp_token.tolist()):
                row.tokens.append(t)
                row.logprobs.append(lp)
                row.versions.append(version)
            if params.top_k_logprobs:
                for row, ids, lps in zip(batch.rows, tk_ids.tolist(), tk_lps.tolist()):
                    row.topk_ids.append(ids)
                    row.topk_logprobs.append(lps)
            if record_kept:
                sizes, flat = kept
                for row, ids in zip(batch.rows, flat.split(sizes.tolist())):
                    row.kept_ids.append(ids.tolist())
            if params.stop_at_code_block:
                at_block = self._closes_code_block(batch.rows, token, params) & ~done
                for i in at_block.nonzero().flatten().tolist():
                    batch.rows[i].at_block = True
                done |= at_block
            ended = done | torch.tensor(
                [len(row.tokens) == params.max_new_tokens for row in batch.rows], device=self.device
            )
            if params.on_step is not None:
                params.on_step(len(batch.rows), int(ended.sum()))
            for i in ended.nonzero().flatten().tolist():
                row = batch.rows[i]
                keep(row, self._generation(row, bool(done[i]), params, record_kept, version is not None))
            batch.drop(ended, token)

    def _generation(self, row, stopped: bool, params: SamplingParams, record_kept: bool, versions: bool):
        K = params.top_k_logprobs
        return Generation(
            prompt_index=row.prompt,
            prompt_ids=row.prompt_ids,
            completion_ids=row.tokens,
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
            logprobs=row.logprobs,
            topk_ids=row.topk_ids if K else None,
            topk_logprobs=row.topk_logprobs if K else None,
            finish_reason=("tool" if row.at_block else "stop") if stopped else "length",
            kept_ids=row.kept_ids if record_kept else None,
            versions=row.versions if versions else None,
        )

    def _new_cache(self, rows: int, capacity: int) -> DynamicCache:
        """An empty KV cache; in one preallocated buffer per layer (`InPlaceLayer`) when every layer
        is full attention."""
        cache = DynamicCache(config=self.model.config)
        if all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.layers = [InPlaceLayer(rows, capacity) for _ in cache.layers]
        return cache

    def _closes_code_block(self, rows: list[_Row], token: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Which rows' completions (their tokens so far, this step's last) now end by closing a
        ```python block. A block closes with a ``` line's newline, so only rows whose new token holds
        a backtick or a newline are decoded."""
        from gppo.tool_format import closed_code_block

        if self._fence_ids is None:
            texts = self.tokenizer.batch_decode([[i] for i in range(self.max_top_k_logprobs)])
            fence = [i for i, t in enumerate(texts) if "`" in t or "\n" in t]
            self._fence_ids = torch.tensor(fence, dtype=torch.long, device=self.device)
        closes = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        for i in torch.isin(token, self._fence_ids).nonzero().flatten().tolist():
            code = closed_code_block(self.tokenizer.decode(rows[i].tokens, skip_special_tokens=True))
            closes[i] = code is not None
            if code is not None and params.on_code_block is not None:  # the tool may start while others decode
                params.on_code_block(rows[i].index, code, len(rows[i].tokens))
        return closes

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gen, record_kept: bool):
        """Pick one token per row; return it with its log-prob, mu's top-K and (record_kept) the
        nucleus as (sizes [rows], ids concatenated by row), all of the distribution that was sampled."""
        kept = None
        # log_softmax(logits / T) by the training pass's own row formula (temperature 0: T = 1), without
        # the kernel's checks and chunking: one call per decoding step
        logp = log_normalize_(logits / (params.temperature if params.temperature > 0 else 1.0))
        if params.temperature == 0:
            token = logp.argmax(dim=-1)
        else:
            if params.top_p < 1:
                logp, kept = top_p_truncate(logp, params.top_p)
                if record_kept:
                    order, sizes = kept
                    width = int(sizes.max())
                    columns = torch.arange(width, device=logp.device)
                    kept = sizes, order[:, :width][columns < sizes[:, None]]
            token = inverse_cdf_sample(logp.exp(), gen)
        lp_token = logp.gather(-1, token[:, None]).squeeze(-1)
        if params.top_k_logprobs:
            tk_lps, tk_ids = logp.topk(params.top_k_logprobs, dim=-1)
            return token, lp_token, tk_ids, tk_lps, kept
        return token, lp_token, None, None, kept


def inverse_cdf_sample(probs: torch.Tensor, gen: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [rows, V]: the first index whose cumulative probability exceeds
    u * total, for u uniform on [0, 1), so P(token = i) = probs_i / total. The sums run in float64,
    so that a 150k-token vocabulary's rounding cannot shift mass between tokens. One uniform per row
    where `torch.multinomial` draws an exponential per vocabulary entry (15% of a decoding step of
    SmolLM2, docs/results.md §16); zero-probability tokens (cut by top-p) are never drawn. `gen`:
    one generator for all rows, or one per row (row i's u then depends on its generator alone)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    if isinstance(gen, torch.Generator):
        u = torch.rand(total.shape, generator=gen, dtype=torch.float64, device=probs.device)
    else:
        u = torch.cat([torch.rand((1, 1), generator=g, dtype=torch.float64, device=probs.device) for g in gen])
    u = u * total
    last_positive = torch.searchsorted(cdf, total)  # where the cumulative sum first reaches the total
    return torch.searchsorted(cdf, u, right=True).minimum(last_positive).squeeze(-1)


def encode(tokenizer, prompts) -> list[list[int]]:
    """Token ids of each prompt: text is tokenized, token ids are taken as they are."""
    prompts = list(prompts)
    if prompts and not isinstance(prompts[0], str):
        return [list(ids) for ids in prompts]
    return tokenizer(prompts)["input_ids"]


def top_p_truncate(logp: torch.Tensor, top_p: float):
    """(log mu_S, (order, |S|)): the nucleus S is the smallest set of most probable tokens whose
    mass reaches `top_p` (a token is kept when the mass strictly before it is < top_p, as
    transformers' TopPLogitsWarper); log mu_S = log mu - log mu(S) on S, -inf elsewhere. `order`
    sorts the vocabulary by descending mu, so S = order[:, :|S|]."""
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    keep_sorted = probs.cumsum(-1) - probs < top_p  # the most probable token always stays
    keep = keep_sorted.scatter(-1, order, keep_sorted)
    truncated = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return truncated, (order, keep_sorted.sum(-1))


class InPlaceLayer(DynamicLayer):
    """A full-attention KV-cache layer held in one buffer of `rows` x `capacity` positions,
    allocated once and written in place. `DynamicLayer` concatenates, copying the whole cache at
    every generated token (about a tenth of the rollout time on CPU); here a step writes one
    position, and sharing a prompt's cache or dropping finished rows moves rows inside the buffer."""

    def __init__(self, rows: int, capacity: int):
        super().__init__()
        self.rows, self.capacity, self.active, self.length = rows, capacity, 0, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            shape = (self.rows, key_states.shape[1], self.capacity, key_states.shape[-1])
            self.key_buffer, self.value_buffer = key_states.new_empty(shape), value_states.new_empty(shape)
            self.active = key_states.shape[0]
        end = self.length + key_states.shape[-2]
        if end > self.capacity or key_states.shape[0] != self.active:
            raise RuntimeError(
                f"KV cache of {self.active} rows x {self.capacity} positions cannot take "
                f"{tuple(key_states.shape)} at position {self.length}"
            )
        self.key_buffer[: self.active, :, self.length : end] = key_states
        self.value_buffer[: self.active, :, self.length : end] = value_states
        self.length = end
        return self._views()

    def _views(self):
        self.keys = self.key_buffer[: self.active, :, : self.length]
        self.values = self.value_buffer[: self.active, :, : self.length]
        return self.keys, self.values

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor, skip: int, room: int) -> None:
        """Rows whose keys and values [b, heads, p, dim] end at the last position join the running
        ones (their positions before are zeros, masked); the `skip` leading positions, masked in
        every running row, go. The buffer is reallocated only when positions move or the rows, or
        `room` more positions, do not fit."""
        b, p = keys.shape[0], keys.shape[-2]
        kept = self.length - skip
        width, rows = max(kept, p), self.active + b
        if skip or width > kept or rows > self.rows or width + room > self.capacity:
            self.rows = self.rows if rows <= self.rows else max(rows, self.rows * 3 // 2)
            self.capacity = max(width + room, self.capacity)
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_zeros((self.rows, old.shape[1], self.capacity, old.shape[-1]))
                new[: self.active, :, width - kept : width] = old[: self.active, :, skip : self.length]
                setattr(self, name, new)
        for buffer, states in ((self.key_buffer, keys), (self.value_buffer, values)):
            buffer[self.active : rows, :, : width - p] = 0
            buffer[self.active : rows, :, width - p : width] = states
        self.active, self.length = rows, width
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Row `indices[d]` becomes row d. Rows are copied one by one, in an order that reads each
        source before it is overwritten, so no temporary copy of the cache is made: descending d
        when every indices[d] <= d (a prompt's cache repeated over its group), ascending when every
        moved row comes from beyond the new size (finished rows replaced by the last live ones)."""
        if not self.is_initialized:
            return
        m, sources = len(indices), indices.tolist()
        if m > self.rows:
            raise RuntimeError(f"KV cache of {self.rows} rows cannot take {m}")
        if all(src <= d for d, src in enumerate(sources)):
            order = range(m - 1, -1, -1)
        elif all(src == d or src >= m for d, src in enumerate(sources)):
            order = range(m)
        else:
            raise ValueError("InPlaceLayer moves rows only to share a prompt or to fill the slots of finished rows")
        for d in order:
            if sources[d] != d:
                self.key_buffer[d, :, : self.length] = self.key_buffer[sources[d], :, : self.length]
                self.value_buffer[d, :, : self.length] = self.value_buffer[sources[d], :, : self.length]
        self.active = m
        self._views()


@dataclass
class _Row:
    """One completion being decoded: `index` (its place in the output, or within its group),
    `prompt` (the prompt's index, or the group's key: rows of one prompt share its prefill) and
    what it has sampled so far."""

    index: int
    prompt: object
    prompt_ids: list[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    kept_ids: list[list[int]] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    at_block: bool = False


class _Batch:
    """The rows under way and their KV cache, left-padded to one width: `mask` [rows, width],
    `next_pos` (each row's position of the token it feeds next) and `token` (that token)."""

    def __init__(self, engine: HFEngine):
        self.engine, self.rows, self.cache, self.version = engine, [], None, None
        self.mask = self.next_pos = self.token = None

    def step(self, new: list[_Row], version, max_new_tokens: int) -> torch.Tensor:
        """The logits of every row's next token, `new` rows appended: the running rows decode one
        token and the new ones are prefilled beside them (their cache joins the running one), or,
        after a change of weights (or with a cache that cannot take rows), every row is recomputed
        from its ids under the current weights."""
        e = self.engine
        if not self.rows:
            self.rows, self.version = new, version
            ids, mask, logits = self._prefill(new, max_new_tokens, into_batch=True)
            return logits
        if version != self.version or (new and not self._in_place()):
            self.rows, self.version = self.rows + new, version
            return self._recompute(max_new_tokens)
        logits = e._forward(self.token[:, None], self.mask, self.next_pos, self.cache)
        if new:
            logits = torch.cat([logits, self._join(new, max_new_tokens)])
        return logits

    def drop(self, ended: torch.Tensor, token: torch.Tensor) -> None:
        """After a step that sampled `token`: the `ended` rows leave (the last live rows move into
        their slots, so few rows are copied) and the others feed their token next."""
        if ended.any():
            keep = (~ended).nonzero().squeeze(-1)
            order = torch.arange(len(keep), device=keep.device)
            order[ended[: len(keep)]] = keep[keep >= len(keep)]
            self.rows = [self.rows[i] for i in order.tolist()]
            if not self.rows:
                self.cache = None
                return
            self.cache.batch_select_indices(order)
            token, self.mask, self.next_pos = token[order], self.mask[order], self.next_pos[order]
        self.token = token
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
        self.next_pos = self.next_pos + 1

    def _left_padded(self, sequences: list[list[int]]):
        e = self.engine
        width = max(len(ids) for ids in sequences)
        ids = torch.full((len(sequences), width), e.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        return ids.to(e.device), mask.to(e.device)

    def _prefill(self, rows: list[_Row], max_new_tokens: int, into_batch: bool):
        """Prefill each distinct prompt of `rows` once and repeat its cache over its rows: into a new
        cache of the batch (`into_batch`), else a cache of their own; (cache, mask, logits) per row."""
        e = self.engine
        starts = [i for i in range(len(rows)) if i == 0 or rows[i].prompt != rows[i - 1].prompt]
        ids, mask = self._left_padded([rows[i].prompt_ids for i in starts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = e._new_cache(len(rows), ids.shape[1] + max_new_tokens) if into_batch else DynamicCache()
        logits = e._forward(ids, mask, positions, cache)
        sizes = torch.tensor([b - a for a, b in zip(starts, [*starts[1:], len(rows)])], device=e.device)
        expand = torch.repeat_interleave(torch.arange(len(starts), device=e.device), sizes)
        cache.batch_select_indices(expand)  # every row of a prompt starts from its cache
        if into_batch:
            self.cache, self.mask, self.next_pos = cache, mask[expand], positions[expand][:, -1:]
        return cache, mask[expand], logits[expand]

    def _recompute(self, max_new_tokens: int) -> torch.Tensor:
        """A new cache of every row from its ids (prompt and tokens so far), under the current weights."""
        e = self.engine
        ids, self.mask = self._left_padded([row.prompt_ids + row.tokens for row in self.rows])
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = e._new_cache(len(self.rows), ids.shape[1] + max_new_tokens)
        self.next_pos = positions[:, -1:]
        return e._forward(ids, self.mask, positions, self.cache)

    def _in_place(self) -> bool:
        return all(isinstance(layer, InPlaceLayer) for layer in self.cache.layers)

    def _join(self, new: list[_Row], max_new_tokens: int) -> torch.Tensor:
        """Prefill the `new` rows apart and put their cache beside the running rows', right-aligned at
        the current position (the positions before them masked); leading positions masked in every
        running row are dropped when they are half the width or the cache must grow anyway."""
        cache, mask, logits = self._prefill(new, max_new_tokens, into_batch=False)
        width, length = self.mask.shape[1], mask.shape[1]
        leading = int((self.mask.cumsum(-1) == 0).all(0).sum())
        layer = self.cache.layers[0]
        grows = len(self.rows) + len(new) > layer.rows or max(width, length) + max_new_tokens > layer.capacity
        skip = leading if grows or 2 * leading >= width else 0
        for running, joining in zip(self.cache.layers, cache.layers):
            running.add_rows(joining.keys, joining.values, skip, max_new_tokens)
        joined = max(width - skip, length)
        self.mask = torch.cat(
            [
                torch.nn.functional.pad(self.mask[:, skip:], (joined - (width - skip), 0)),
                torch.nn.functional.pad(mask, (joined - length, 0)),
            ]
        )
        self.next_pos = torch.cat([self.next_pos, mask.sum(-1, keepdim=True) - 1])
        self.rows = self.rows + new
        return logits
