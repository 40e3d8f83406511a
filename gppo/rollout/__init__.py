"""Rollout engines: one interface (`RolloutEngine`), HF transformers and vLLM implementations."""

from gppo.rollout.base import Generation, RolloutEngine, SamplingParams

ENGINES = ("hf", "vllm")


def make_engine(name: str, model, tokenizer, model_path=None, device="cpu", batch_size: int = 256,
                gpu_memory_utilization: float = 0.5, seed: int = 0) -> RolloutEngine:
    """The engine called `name`; vLLM loads `model_path` and is synced from `model` after updates."""
    if name == "hf":
        from gppo.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, device=device, batch_size=batch_size)
    if name == "vllm":
        from gppo.rollout.vllm import VLLMEngine

        return VLLMEngine(model_path, tokenizer, gpu_memory_utilization=gpu_memory_utilization, seed=seed)
    raise ValueError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")


__all__ = ["ENGINES", "Generation", "RolloutEngine", "SamplingParams", "make_engine"]
