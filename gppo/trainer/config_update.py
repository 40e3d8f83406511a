"""`gppo train`'s update options (a base of TrainConfig): optimizer, schedule, forward memory and precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gppo.core import closest
from gppo.models.forward import ForwardOptions
from gppo.options import ConfigError, option
from gppo.rollout.options import resolve_device

_opt = option
NO_WARMUP_SCHEDULES = ("constant", "reduce_lr_on_plateau")  # transformers' get_scheduler ignores warmup there


def check_lr_schedule(name: str) -> None:
    from transformers import SchedulerType

    names = [s.value for s in SchedulerType]
    if name not in names:
        raise ValueError(f"is not a transformers scheduler{closest(name, names)}; choose one of {names}")


@dataclass
class UpdateOptions:
    """How a run updates the policy from a rollout batch, and how its forwards run."""

    # update
    steps: int = _opt(60, "RL steps (rollout + update)", "update", ge=1)
    epochs: int = _opt(2, "passes over each rollout batch", "update", ge=1)
    mini_batch_size: int = _opt(128, "sequences per optimizer step", "update", ge=1)
    micro_batch_size: int = _opt(128, "sequences per forward/backward (gradient accumulation)", "update", ge=1)
    lr: float = _opt(1e-4, "AdamW learning rate", "update", gt=0)
    lr_schedule: str = _opt(
        "constant",
        "transformers scheduler name: constant, linear, cosine, ... (with warmup)",
        "update",
        check=check_lr_schedule,
    )
    warmup_steps: int = _opt(0, "optimizer steps of linear warm-up", "update", ge=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay", "update", ge=0)
    max_grad_norm: float = _opt(1.0, "gradient clipping norm (0: off)", "update", ge=0)
    gradient_checkpointing: bool = _opt(
        False,
        "recompute each decoder layer's activations in the backward instead of keeping them (transformers' "
        "activation checkpointing, non-reentrant): about one more forward of time for the activation memory of one "
        "layer; turns share_prompt off, since the recomputed layers drop the key/value cache",
        "update",
    )
    share_prompt: bool | None = _opt(
        None,
        "in the update, run each prompt once for all its completions (its key/value cache is expanded to them; "
        "the gradient flows back through it once; mini-batches hold whole groups). Unset: on, off with "
        "gradient_checkpointing",
        "update",
    )
    logits_chunk_size: int | None = _opt(
        None,
        "completion tokens whose [tokens, vocabulary] logits exist at once in a forward (unset: 2**24 logits, "
        "e.g. 110 tokens at a 151,936-token vocabulary): lower saves memory, higher may run faster",
        "update",
        ge=1,
        example=128,
    )
    mixed_precision: Literal["auto", "no", "bf16"] = _opt(
        "auto",
        "bf16: the update's and the old/reference passes' forward run under bfloat16 autocast, while weights, "
        "gradients and AdamW stay float32 (needs --dtype float32); no: float32 throughout; auto: bf16 on CUDA "
        "GPUs that compute bfloat16 natively (compute capability 8.0+) with --dtype float32, no elsewhere (on "
        "CPUs float32, where bf16 rarely pays: docs/guide.md)",
        "update",
    )
    tf32: bool | None = _opt(
        None,
        "TF32 tensor cores for float32 matmuls on CUDA (TRL's --tf32): unset means on with a CUDA device; "
        "false keeps full float32 matmuls; a CPU has no TF32, so true there is refused",
        "update",
    )
    skip_zero_gradient_updates: bool = _opt(
        False,
        "skip an optimizer update whose gradient is exactly 0 (every group's rewards equal, or every "
        "token masked), lr schedule included: AdamW would move the weights by momentum alone (docs/results.md §13)",
        "update",
    )

    def _check_forward_knobs(self) -> None:
        if self.share_prompt and self.gradient_checkpointing:
            raise ConfigError(
                "share_prompt true needs the prompt's key/value cache in the backward, which "
                "gradient_checkpointing drops (transformers recomputes each layer without it): set "
                "--share_prompt false, or leave it unset (it then turns off with checkpointing)"
            )
        if self.tf32 and resolve_device(self.device).type != "cuda":
            raise ConfigError(
                f"tf32 true selects TF32 matmuls on a CUDA GPU, but this run is on {resolve_device(self.device)}: "
                "unset --tf32 (or run on a GPU)"
            )
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise ConfigError(
                f"mixed_precision {self.mixed_precision} keeps float32 weights and runs the forward in "
                f"bfloat16, but --dtype is {self.dtype}: use --dtype float32 with it, or "
                f"--mixed_precision no to train in {self.dtype} throughout"
            )

    def resolved_mixed_precision(self, device: torch.device) -> str:
        """'bf16' or 'no' on `device`: `mixed_precision`, 'auto' resolved (bf16 on a CUDA GPU of
        compute capability 8.0+ when the weights are float32, as verl's and TRL's defaults; float32
        on CPUs and older GPUs)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        native_bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
        return "bf16" if native_bf16 and self.dtype == "float32" else "no"

    def uses_tf32(self, device: torch.device) -> bool:
        """Whether float32 matmuls use TF32 on `device`: `tf32`, unset meaning on for CUDA."""
        return device.type == "cuda" and self.tf32 is not False

    def forward_options(self, device: torch.device) -> ForwardOptions:
        """How the trainer's policy forwards run on `device`: prompt sharing (unset: on unless
        checkpointing), logits chunk size, bfloat16 autocast (`resolved_mixed_precision`)."""
        share = not self.gradient_checkpointing if self.share_prompt is None else self.share_prompt
        return ForwardOptions(
            share_prompt=share,
            chunk_size=self.logits_chunk_size,
            autocast=torch.bfloat16 if self.resolved_mixed_precision(device) == "bf16" else None,
        )
