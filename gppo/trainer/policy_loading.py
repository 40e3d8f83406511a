"""The trained policy and its KL reference as a run loads them: the base or a checkpoint, full
weights or a LoRA adapter (new, resumed, or given as --model), and the reference's form."""

from __future__ import annotations

import contextlib
from pathlib import Path

from gppo.models.adapters import add_adapter, is_adapter_dir, reference_adapter, set_adapter_base
from gppo.models.assets import embedded_checkpoint
from gppo.models.loading import load_model_and_tokenizer
from gppo.options import ConfigError, refuse_ignored
from gppo.trainer.config import TrainConfig
from gppo.trainer.data import derived_seed
from gppo.trainer.rollout_policy import DTYPES


def base_model_path(config: TrainConfig) -> Path:
    """--model, or the embedded tiny model warm-started on the built-in task."""
    if config.model is not None:
        return Path(config.model)
    if config.data is not None:
        raise ConfigError("--data needs --model: the embedded tiny model only knows the built-in tasks")
    return embedded_checkpoint(config.task)


def load_policy(config: TrainConfig, base: Path, checkpoint: Path | None):
    """(model, tokenizer): the checkpoint's or the base's weights; with --use_peft the base
    (in --dtype) with the checkpoint's adapter, or a fresh one (B = 0: the base's policy)."""
    c, dtype = config, DTYPES[config.dtype]
    if checkpoint is not None and is_adapter_dir(checkpoint) != c.use_peft:
        held = "a LoRA adapter" if is_adapter_dir(checkpoint) else "full weights"
        raise ConfigError(
            f"--use_peft {str(c.use_peft).lower()}: checkpoint {checkpoint} holds {held}; resume with the "
            f"run's own setting (--use_peft {str(not c.use_peft).lower()})"
        )
    if checkpoint is None and is_adapter_dir(base):  # --model is an adapter: train it on
        if not c.use_peft:
            raise ConfigError(
                f"--model {base} is a LoRA adapter: train it further with --use_peft, or "
                "give its merged weights (a run with --merge_lora writes them to RUN_DIR/merged/)"
            )
        refuse_ignored(
            c, ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"], "to a new adapter, not to --model's"
        )
    if c.use_peft and not is_adapter_dir(base):
        refuse_ignored(
            c,
            ["lora_reference"],
            "when --model is a LoRA adapter (a new adapter's KL reference is the base, its first policy)",
        )
    if checkpoint is not None or not c.use_peft or is_adapter_dir(base):
        return load_model_and_tokenizer(checkpoint or base, dtype, trainable_adapter=True)
    model, tokenizer = load_model_and_tokenizer(base, dtype)
    model = add_adapter(model, c.lora_options(), derived_seed(c.seed, 5_555_555))
    set_adapter_base(model, c.model or base)
    return model, tokenizer


def lora_reference(config: TrainConfig, base: Path) -> str | None:
    """With LoRA, what the KL reference is: 'adapter' (--model's adapter, frozen) or 'base' (the
    model with its adapter disabled); --lora_reference, unset: 'adapter' when --model is an
    adapter, else 'base' (a new adapter starts as the base). None without LoRA."""
    if not config.use_peft:
        return None
    return config.lora_reference or ("adapter" if is_adapter_dir(base) else "base")


@contextlib.contextmanager
def reference_model(model, ref_model, lora_reference: str | None):
    """The KL term's reference policy: `ref_model` (a frozen copy of --model) when there is one, or
    with LoRA `model` itself under its frozen REFERENCE adapter or with its adapter disabled (peft's
    disable_adapter, as TRL does): no second copy of the base."""
    if ref_model is not None:
        yield ref_model
    elif lora_reference == "adapter":
        with reference_adapter(model):
            yield model
    else:
        with model.disable_adapter():
            yield model
