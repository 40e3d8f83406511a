"""`VLLMEngine`: rollouts with vLLM on a GPU (`pip install gppo[vllm]`), same interface as HFEngine.

vLLM returns log-probs of the *processed* distribution (temperature and top-p applied) only with
`logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2), which this engine sets: the recorded mu is
then the distribution that was sampled, as the trainer assumes. vLLM does not return the top-p
nucleus it sampled from, so training rollouts with top_p < 1 (which the trainer scores on that
nucleus) are refused; evaluation may use any top_p. vLLM caps the number of top-K
log-probs per token (`max_logprobs`, 20 by default), so presets with top_k > 20 need a larger
`max_logprobs`. Weights are pushed from the training model after every update
(`update_weights`), in the same process (colocated; single GPU).

Not exercised by the CPU test suite (vLLM needs a GPU); the HF engine covers the same interface.
"""

from __future__ import annotations

import os
from typing import Sequence

from gppo.rollout.base import Generation, SamplingParams


class VLLMEngine:
    def __init__(self, model_path: str, tokenizer, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, max_logprobs: int = 20, dtype: str = "auto", seed: int = 0):
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("engine='vllm' needs vLLM on a GPU machine: pip install gppo[vllm]") from err
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the model in this process
        self.tokenizer = tokenizer
        self.max_top_k_logprobs = max_logprobs
        self.llm = LLM(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       max_logprobs=max_logprobs, logprobs_mode="processed_logprobs",
                       enable_prefix_caching=True)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        from vllm import SamplingParams as VSamplingParams

        if params.record_kept_ids and params.top_p < 1 and params.temperature > 0:
            raise ValueError("vLLM does not report the top-p nucleus it sampled from, which the trainer needs "
                             "to score pi on the same truncated distribution: train with rollout_top_p 1 on "
                             "engine vllm, or use engine hf")
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(f"top_k_logprobs={params.top_k_logprobs} exceeds vLLM's max_logprobs="
                             f"{self.max_top_k_logprobs}; lower the preset's top_k")
        sampling = VSamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                   max_tokens=params.max_new_tokens, seed=params.seed,
                                   logprobs=max(params.top_k_logprobs, 0))
        encoded = [self.tokenizer(p)["input_ids"] for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], sampling, use_tqdm=False)
        generations = []
        for i, (ids, out) in enumerate(zip(encoded, outputs)):
            for completion in out.outputs:
                generations.append(_generation(i, ids, completion, params.top_k_logprobs, self.tokenizer))
        return generations

    def update_weights(self, model) -> None:
        """Copy the training model's weights into vLLM's model (same process, same GPU)."""
        runner = self.llm.llm_engine.model_executor.driver_worker
        runner = getattr(runner, "worker", runner).model_runner
        runner.model.load_weights(weights=((name, p.data) for name, p in model.named_parameters()))
        self.llm.reset_prefix_cache()


def _generation(index: int, prompt_ids: list[int], completion, top_k: int, tokenizer) -> Generation:
    token_ids = list(completion.token_ids)
    logprobs, topk_ids, topk_logprobs = [], [], []
    for token, entries in zip(token_ids, completion.logprobs or []):
        logprobs.append(entries[token].logprob)
        if top_k:
            ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank <= top_k)
            if len(ranked) < top_k:
                raise RuntimeError(f"vLLM returned {len(ranked)} top log-probs for a token, {top_k} requested")
            topk_ids.append([tid for _, tid, _ in ranked[:top_k]])
            topk_logprobs.append([lp for _, _, lp in ranked[:top_k]])
    return Generation(index, list(prompt_ids), token_ids, tokenizer.decode(token_ids, skip_special_tokens=True),
                      logprobs, topk_ids if top_k else None, topk_logprobs if top_k else None,
                      "length" if completion.finish_reason == "length" else "stop")
