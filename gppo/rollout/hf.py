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
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gppo.core import log_normalize_
from gppo.rollout.base import Generation, SamplingParams, check_row_seeds


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
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(
                f"invalid SamplingParams {params}: need temperature >= 0, 0 < top_p <= 1, "
                "n >= 1 and max_new_tokens >= 1"
            )
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(
                f"top_k_logprobs={params.top_k_logprobs} exceeds the vocabulary size {self.max_top_k_logprobs}"
            )
        encoded = encode(self.tokenizer, prompts)
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("a prompt is empty after tokenization; every prompt needs at least one token")
        jobs = [(i, ids) for i, ids in enumerate(encoded) for _ in range(params.n)]
        check_row_seeds(params, len(encoded))
        if params.row_seeds is None:  # one stream for the batch
            gen = torch.Generator(self.device)
            if params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(params.seed)
        else:
            gen = [torch.Generator(self.device).manual_seed(seed) for seed in params.row_seeds]
        was_training = self.model.training
        self.model.eval()
        try:
            return [
                g
                for start in range(0, len(jobs), self.batch_size)
                for g in self._generate_batch(
                    jobs[start : start + self.batch_size],
                    params,
                    gen if params.row_seeds is None else gen[start : start + self.batch_size],
                    start,
                )
            ]
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
    def _generate_batch(self, jobs, params: SamplingParams, gen, first: int = 0) -> list[Generation]:
        """`gen`: the batch's generator, or one per row (`row_seeds`)."""
        B, K = len(jobs), params.top_k_logprobs
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        # Distinct prompts in job order (a prompt's n copies are consecutive): prefill each once.
        starts = [row for row in range(B) if row == 0 or jobs[row][0] != jobs[row - 1][0]]
        unique = [jobs[row][1] for row in starts]
        L = max(len(ids) for ids in unique)
        input_ids = torch.full((len(unique), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(unique), L), dtype=torch.long)
        for row, ids in enumerate(unique):
            input_ids[row, L - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, L - len(ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        version = params.policy_version() if params.policy_version is not None else None
        cache = self._new_cache(B, L + params.max_new_tokens)
        logits = self._forward(input_ids, mask, positions, cache)
        group_sizes = torch.tensor([b - a for a, b in zip(starts, [*starts[1:], B])], device=self.device)
        expand = torch.repeat_interleave(torch.arange(len(unique), device=self.device), group_sizes)
        cache.batch_select_indices(expand)  # every row of a group starts from its prompt's cache
        logits, mask, step_pos = logits[expand], mask[expand], positions[expand][:, -1:]
        sequences = input_ids[expand] if version is not None else None  # each row's ids, to recompute its cache

        active = torch.arange(B, device=self.device)  # rows still generating
        history = [[] for _ in range(B)] if params.stop_at_code_block else None  # tokens so far, per row
        at_block = torch.zeros(B, dtype=torch.bool, device=self.device)
        steps = []  # per step: (active rows, token, its log-prob, top-K ids, top-K log-probs, kept sets)
        step_versions = []  # per step: the weights version that gave its logits (policy_version)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        token = None  # the previous step's sampled tokens
        for step in range(params.max_new_tokens):
            if step:
                newer = version
                if version is not None:
                    sequences = torch.cat([sequences, token[:, None]], dim=-1)
                    newer = params.policy_version()
                if newer != version:  # new weights: every row's cache is recomputed under them
                    version, cache = newer, self._new_cache(len(active), L + params.max_new_tokens)
                    logits = self._forward(sequences, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
                else:
                    logits = self._forward(token[:, None], mask, step_pos, cache)
            step_versions.append(version)
            draws = gen if isinstance(gen, torch.Generator) else [gen[row] for row in active.tolist()]
            token, lp_token, tk_ids, tk_lps, kept = self._sample(logits, params, draws, record_kept)
            steps.append((active, token, lp_token, tk_ids, tk_lps, kept))
            done = torch.isin(token, self.eos_ids)
            if history is not None:
                done |= self._closes_code_block(active, token, history, params, first)
                at_block[active[done & ~torch.isin(token, self.eos_ids)]] = True
            finished[active[done]] = True
            if params.on_step is not None:
                last = step == params.max_new_tokens - 1
                params.on_step(len(active), len(active) if last else int(done.sum()))
            if done.all():
                break
            if done.any():
                # Finished rows leave; the last live rows move into their slots (few rows copied).
                keep = (~done).nonzero().squeeze(-1)
                order = torch.arange(len(keep), device=self.device)
                order[done[: len(keep)]] = keep[keep >= len(keep)]
                cache.batch_select_indices(order)
                active, token, mask, step_pos = active[order], token[order], mask[order], step_pos[order]
                if sequences is not None:
                    sequences = sequences[order]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
            step_pos = step_pos + 1

        T = len(steps)
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, T), device=self.device)
        topk_ids = torch.zeros((B, T, K), dtype=torch.long, device=self.device)
        topk_lps = torch.zeros((B, T, K), device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        kept_ids = [[] for _ in range(B)]
        for t, (rows, token, lp_token, tk_ids, tk_lps, kept) in enumerate(steps):
            tokens[rows, t], logprobs[rows, t], lengths[rows] = token, lp_token, t + 1
            if K:
                topk_ids[rows, t], topk_lps[rows, t] = tk_ids, tk_lps
            if record_kept:
                sizes, flat = kept
                for row, ids in zip(rows.tolist(), flat.split(sizes.tolist())):
                    kept_ids[row].append(ids.tolist())
        tokens, logprobs, lengths, finished = tokens.tolist(), logprobs.tolist(), lengths.tolist(), finished.tolist()
        topk_ids, topk_lps = (topk_ids.tolist(), topk_lps.tolist()) if K else (None, None)
        completions = [tokens[row][:n] for row, n in enumerate(lengths)]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return [
            Generation(
                prompt_index=i,
                prompt_ids=list(ids),
                completion_ids=completions[row],
                text=texts[row],
                logprobs=logprobs[row][:n],
                topk_ids=topk_ids[row][:n] if K else None,
                topk_logprobs=topk_lps[row][:n] if K else None,
                finish_reason=("tool" if at_block[row] else "stop") if finished[row] else "length",
                kept_ids=kept_ids[row] if record_kept else None,
                versions=step_versions[:n] if version is not None else None,
            )
            for row, ((i, ids), n) in enumerate(zip(jobs, lengths))
        ]

    def _new_cache(self, rows: int, capacity: int) -> DynamicCache:
        """An empty KV cache; in one preallocated buffer per layer (`InPlaceLayer`) when every layer
        is full attention."""
        cache = DynamicCache(config=self.model.config)
        if all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.layers = [InPlaceLayer(rows, capacity) for _ in cache.layers]
        return cache

    def _closes_code_block(self, active, token, history, params: SamplingParams, first: int) -> torch.Tensor:
        """Which active rows' completions now end by closing a ```python block (`history` gets this
        step's tokens). A block closes with a ``` line's newline, so only rows whose new token holds
        a backtick or a newline are decoded."""
        from gppo.tool_format import closed_code_block

        if self._fence_ids is None:
            texts = self.tokenizer.batch_decode([[i] for i in range(self.max_top_k_logprobs)])
            fence = [i for i, t in enumerate(texts) if "`" in t or "\n" in t]
            self._fence_ids = torch.tensor(fence, dtype=torch.long, device=self.device)
        for row, t in zip(active.tolist(), token.tolist()):
            history[row].append(t)
        closes = torch.zeros(len(active), dtype=torch.bool, device=self.device)
        for i in torch.isin(token, self._fence_ids).nonzero().flatten().tolist():
            text = self.tokenizer.decode(history[int(active[i])], skip_special_tokens=True)
            code = closed_code_block(text)
            closes[i] = code is not None
            if code is not None and params.on_code_block is not None:  # the tool may start while others decode
                params.on_code_block(first + int(active[i]), code, len(history[int(active[i])]))
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
