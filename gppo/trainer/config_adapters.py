"""`gppo train`'s LoRA adapter options (a base of TrainConfig), their checks and what they resolve to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gppo.models.adapters import LoraOptions, require_peft
from gppo.options import ConfigError, option, refuse_ignored

_opt = option


@dataclass
class AdapterOptions:
    """Training a LoRA adapter instead of every weight (gppo.models.adapters)."""

    # LoRA adapters (gppo.models.adapters)
    use_peft: bool = _opt(
        False,
        "train a LoRA adapter on the frozen base model instead of every weight (peft, pip install "
        "'gppo[peft]'): the optimizer holds the adapter alone, checkpoints and final/ hold it in peft's "
        "format, the KL reference is the base with the adapter disabled (--model's adapter, frozen, when "
        "--model is one: --lora_reference); --dtype bfloat16 keeps the base in bfloat16 and the adapter in float32",
        "LoRA adapters",
    )
    lora_r: int = _opt(16, "LoRA rank r", "LoRA adapters", ge=1)
    lora_alpha: float = _opt(32.0, "LoRA alpha: the adapter's update is scaled by alpha / r", "LoRA adapters", gt=0)
    lora_dropout: float = _opt(
        0.0,
        "dropout on the adapter's input in the update; 0 by default (TRL's is 0.05) so that the first "
        "update's ratio pi/mu is exactly 1 on-policy, as without LoRA",
        "LoRA adapters",
        ge=0,
        lt=1,
    )
    lora_target_modules: list[str] = _opt(
        ["all-linear"],
        "the Linear layers that get an adapter: all-linear (every one but the output layer) or names, "
        "e.g. q_proj v_proj",
        "LoRA adapters",
    )
    lora_sync: Literal["adapter", "merged"] | None = _opt(
        None,
        "how vLLM (--engine vllm) gets the adapter after each update: merged (W + alpha/r B A pushed through the "
        "weight reload) or adapter (saved and served per request, vLLM's LoRARequest; vLLM built with "
        "enable_lora); unset: merged, which sampled 4.5x faster on vLLM's CPU build and pays for its slower sync "
        "after 25 sampled tokens (docs/results.md §17)",
        "LoRA adapters",
    )
    lora_reference: Literal["adapter", "base"] | None = _opt(
        None,
        "the KL reference when --model is a LoRA adapter trained on: adapter (that adapter, frozen, as full "
        "fine-tuning's reference is --model) or base (the base with the adapter disabled); unset: adapter. A new "
        "adapter's reference is the base, its first policy",
        "LoRA adapters",
    )
    merge_lora: bool = _opt(
        False,
        "at the end, also write the base with the adapter merged into it (W + alpha/r B A) to "
        "RUN_DIR/merged/, a plain model directory",
        "LoRA adapters",
    )

    def _check_adapter_knobs(self) -> None:
        if not self.use_peft:
            refuse_ignored(
                self,
                [
                    "lora_r",
                    "lora_alpha",
                    "lora_dropout",
                    "lora_target_modules",
                    "lora_sync",
                    "lora_reference",
                    "merge_lora",
                ],
                "with --use_peft",
            )
            return
        if self._objective.kl_coef == 0:
            refuse_ignored(self, ["lora_reference"], "with a KL term (--kl_coef > 0)")
        if self.engine != "vllm":
            refuse_ignored(self, ["lora_sync"], "with --engine vllm")
        if self.rollout_quantization != "none":
            raise ConfigError(
                f"--rollout_quantization {self.rollout_quantization} with --use_peft: int8 rollouts quantize full "
                "weights, not an adapter: unset it"
            )
        require_peft()

    def resolved_lora_sync(self) -> str | None:
        """How vLLM gets the adapter (`lora_sync`, unset: merged), or None without LoRA or vLLM."""
        if not self.use_peft or self.engine != "vllm":
            return None
        return self.lora_sync or "merged"

    def lora_options(self) -> LoraOptions:
        return LoraOptions(self.lora_r, self.lora_alpha, self.lora_dropout, tuple(self.lora_target_modules))
