"""The rollout engine of a run: hf or vLLM over the rollout policy, wrapped with the run's tools,
checked against what the objective needs it to record."""

from __future__ import annotations

from pathlib import Path

import torch

from gppo.core import GPPOConfig
from gppo.models.adapters import adapter_rank
from gppo.options import ConfigError
from gppo.prompts import PromptBuilder
from gppo.rollout import make_engine
from gppo.rollout.tools import TOOLS, ToolEngine, template_tool_turn
from gppo.trainer.config import TrainConfig
from gppo.trainer.rollout_policy import RolloutPolicy


def build_engine(
    config: TrainConfig,
    loss_config: GPPOConfig,
    model: torch.nn.Module,
    rollout_policy: RolloutPolicy,
    tokenizer,
    prompts: PromptBuilder,
    device: torch.device,
    model_path: Path,
):
    """The engine that samples from `rollout_policy` (vLLM: from its own copy of `model_path`, then
    `model`'s adapter with LoRA), calling the run's tools in training rollouts and evaluation alike (a
    chat template's tool role answers), refused when it cannot record mu's top-K the estimator reads."""
    top_k = loss_config.rollout_top_k
    engine = make_engine(
        config.engine,
        rollout_policy.model,
        tokenizer,
        model_path=model_path,
        device=device,
        batch_size=config.rollout_batch_size,
        seed=config.seed,
        dtype=config.sampling_dtype(device),
        kv_cache_gb=config.vllm_kv_cache_gb,
        compile=config.compiles_vllm(),
        max_logprobs=max(top_k, 1),
        top_p_masks=config.rollout_top_p < 1,
        lora_rank=adapter_rank(model) if config.resolved_lora_sync() == "adapter" else 0,
        code_block_stops=bool(config.tools),
        own_process=config.engine == "vllm" and config.vllm_in_own_process(),
        cpu_threads=config.vllm_threads,
        server=config.engine == "vllm" and config.vllm_server,
    )
    if config.use_peft:
        engine.update_weights(model)  # a resumed or given adapter (a no-op for the hf engine)
    if config.tools:
        tool = TOOLS[config.tools[0]](timeout_s=config.tool_timeout_s, workers=config.tool_workers)
        turn = template_tool_turn(tokenizer) if prompts.uses_chat_template else None
        engine = ToolEngine(
            engine, tokenizer, tool, config.max_tool_calls, config.tool_output_tokens, turn, workers=config.tool_workers
        )
    if top_k > engine.max_top_k_logprobs:
        raise ConfigError(
            f"preset {config.preset!r} (estimator {loss_config.estimator!r}) needs mu's top-{top_k} "
            f"log-probs per token, but engine {config.engine!r} records at most "
            f"{engine.max_top_k_logprobs}: lower --top_k or use another estimator"
        )
    return engine
