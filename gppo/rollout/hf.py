"""`HFEngine`: sampling with any transformers causal LM through a hand-written KV-cache loop.

The loop sees every step's logits, so the behaviour policy's log-probs (and top-K) are recorded
from exactly the distribution that was sampled: log_softmax(logits / T), after top-p truncation
when `top_p < 1` (top-K entries outside the kept set then read -inf). Greedy decoding
(`temperature == 0`) records log-probs at T = 1 and ignores `top_p`.
Prompts are tokenized as the tokenizer does by default (with a BOS where it adds one) and
left-padded with matching `attention_mask` and `position_ids`; a sequence leaves the batch (and
the cache) as soon as it emits an EOS token. The EOS token is kept as the last entry of
`completion_ids`/`logprobs` (the trainer must learn to stop) but not in `text`.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from gppo.rollout.base import Generation, SamplingParams


class HFEngine:
    """Sample `n` completions per prompt, `batch_size` sequences at a time.

    `device=None` keeps the model where it is. A sequence stops at the tokenizer's EOS or at any
    EOS id of the model's generation_config (instruct models often have several).
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
        extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        extra = extra if isinstance(extra, (list, tuple)) else [extra]
        eos = {tokenizer.eos_token_id, *(e for e in extra if e is not None)}
        self.eos_ids = torch.tensor(sorted(eos), device=self.device)
        self.max_top_k_logprobs = model.get_output_embeddings().weight.shape[0]
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt, grouped by prompt in prompt order."""
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(f"invalid SamplingParams {params}: need temperature >= 0, 0 < top_p <= 1, "
                             "n >= 1 and max_new_tokens >= 1")
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(f"top_k_logprobs={params.top_k_logprobs} exceeds the vocabulary size "
                             f"{self.max_top_k_logprobs}")
        gen = torch.Generator(self.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        encoded = self.tokenizer(list(prompts))["input_ids"]
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("a prompt is empty after tokenization; every prompt needs at least one token")
        jobs = [(i, ids) for i, ids in enumerate(encoded) for _ in range(params.n)]
        was_training = self.model.training
        self.model.eval()
        try:
            return [g for start in range(0, len(jobs), self.batch_size)
                    for g in self._generate_batch(jobs[start:start + self.batch_size], params, gen)]
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def _generate_batch(self, jobs, params: SamplingParams, gen: torch.Generator) -> list[Generation]:
        B, L, K = len(jobs), max(len(ids) for _, ids in jobs), params.top_k_logprobs
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for row, (_, ids) in enumerate(jobs):
            input_ids[row, L - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[row, L - len(ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        step_ids, step_pos = input_ids, (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        active = torch.arange(B, device=self.device)  # rows still generating
        steps = []  # per step: (active rows, token, its log-prob, top-K ids, top-K log-probs)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        for _ in range(params.max_new_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                use_cache=True, **{self._cache_kw: cache}, **self._keep_last).logits
            token, lp_token, tk_ids, tk_lps = self._sample(logits[:, -1].float(), params, gen)
            steps.append((active, token, lp_token, tk_ids, tk_lps))
            done = torch.isin(token, self.eos_ids)
            finished[active[done]] = True
            if done.all():
                break
            if done.any():
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, token, mask, step_pos = active[keep], token[keep], mask[keep], step_pos[keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
            step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1

        T = len(steps)
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, T), device=self.device)
        topk_ids = torch.zeros((B, T, K), dtype=torch.long, device=self.device)
        topk_lps = torch.zeros((B, T, K), device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        for t, (rows, token, lp_token, tk_ids, tk_lps) in enumerate(steps):
            tokens[rows, t], logprobs[rows, t], lengths[rows] = token, lp_token, t + 1
            if K:
                topk_ids[rows, t], topk_lps[rows, t] = tk_ids, tk_lps
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
                finish_reason="stop" if finished[row] else "length",
            )
            for row, ((i, ids), n) in enumerate(zip(jobs, lengths))
        ]

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator):
        """Pick one token per row; return it with its log-prob and mu's top-K, all taken from
        the distribution that was sampled."""
        if params.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            token = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            if params.top_p < 1:
                logp = torch.log_softmax(_top_p_filter(logp, params.top_p), dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        lp_token = logp.gather(-1, token[:, None]).squeeze(-1)
        if params.top_k_logprobs:
            tk_lps, tk_ids = logp.topk(params.top_k_logprobs, dim=-1)
            return token, lp_token, tk_ids, tk_lps
        return token, lp_token, None, None


def _top_p_filter(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every token outside the smallest set whose probability reaches `top_p`."""
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
    drop_sorted = mass_before >= top_p  # the most probable token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logp.masked_fill(drop, float("-inf"))
