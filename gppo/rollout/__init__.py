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
    server: bool = False,
) -> RolloutEngine:
    """The engine called `name`. HF samples from `model` itself; vLLM loads `model_path` (the same
    weights) in `dtype` (default: `model`'s) and is synced from `model` by `update_weights`. The
    other keywords are vLLM's (gppo.rollout.vllm.VLLMEngine); `server`: vLLM's own OpenAI-compatible
    server, in a process of its own (gppo.rollout.vllm_server.VLLMServerEngine)."""
    if name == "hf":
        from gppo.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, device=device, batch_size=batch_size)
    if name == "vllm":
        from gppo.rollout.hf import eos_token_ids

        shared = dict(
            dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."),
            kv_cache_gb=kv_cache_gb,
            compile=compile,
            max_logprobs=max_logprobs,
            seed=seed,
            code_block_stops=code_block_stops,
            cpu_threads=cpu_threads,
        )
        if server:
            from gppo.rollout.vllm_server import VLLMServerEngine

            if lora_rank or top_p_masks:
                raise ValueError(
                    "vLLM's server engine serves no adapter per request and returns no top-p nucleus: "
                    "send merged LoRA weights (lora_rank=0) and sample with top_p 1"
                )
            return VLLMServerEngine(model_path, tokenizer, eos_token_ids(model, tokenizer), **shared)
        from gppo.rollout.vllm import VLLMEngine

        return VLLMEngine(
            model_path,
            tokenizer,
            eos_token_ids(model, tokenizer),
            top_p_masks=top_p_masks,
            lora_rank=lora_rank,
            own_process=own_process,
            **shared,
        )
    raise ValueError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")


__all__ = ["ENGINES", "Generation", "GroupRequest", "RolloutEngine", "SamplingParams", "make_engine"]
