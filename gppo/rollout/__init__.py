"""Rollout engines: one interface (`RolloutEngine`), HF transformers and vLLM implementations."""

from gppo.rollout.base import Generation, GroupRequest, RolloutEngine, SamplingParams

ENGINES = ("hf", "vllm")


def make_engine(
    name: str,
    model,
    tokenizer,
    model_path=None,
    device="cpu",
    batch_size: int = 256,
    seed: int = 0,
    dtype: str | None = None,
    kv_cache_gb: float = 1.0,
    compile: bool = False,
    max_logprobs: int = 20,
    top_p_masks: bool = False,
    lora_rank: int = 0,
    code_block_stops: bool = False,
    own_process: bool = False,
    cpu_threads: int | None = None,
) -> RolloutEngine:
    """The engine called `name`. HF samples from `model` itself; vLLM loads `model_path` (the same
    weights) in `dtype` (default: `model`'s) and is synced from `model` by `update_weights`. The
    other keywords are vLLM's (gppo.rollout.vllm.VLLMEngine)."""
    if name == "hf":
        from gppo.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, device=device, batch_size=batch_size)
    if name == "vllm":
        from gppo.rollout.hf import eos_token_ids
        from gppo.rollout.vllm import VLLMEngine

        dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
        return VLLMEngine(
            model_path,
            tokenizer,
            eos_token_ids(model, tokenizer),
            dtype=dtype,
            kv_cache_gb=kv_cache_gb,
            compile=compile,
            max_logprobs=max_logprobs,
            top_p_masks=top_p_masks,
            seed=seed,
            lora_rank=lora_rank,
            code_block_stops=code_block_stops,
            own_process=own_process,
            cpu_threads=cpu_threads,
        )
    raise ValueError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")


__all__ = ["ENGINES", "Generation", "GroupRequest", "RolloutEngine", "SamplingParams", "make_engine"]
