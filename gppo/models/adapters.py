"""LoRA adapters on a frozen base model, through the `peft` library (the optional extra gppo[peft]).

A LoRA layer replaces W x by W x + s B A x with A [r, in], B [out, r] and s = alpha / r (Hu et
al. 2021, "LoRA"); peft starts B at 0, so the adapted model's first policy is the base's exactly.
Only A and B train; the base may sit in bfloat16 while the adapter stays float32 (peft's
`autocast_adapter_dtype`). docs/guide.md, "LoRA adapters".

An adapter directory is what `PeftModel.save_pretrained` writes (adapter_config.json and the
adapter's weights); `gppo` records the base it needs in adapter_config.json's
`base_model_name_or_path`, so that `load_model_and_tokenizer` (and with it `gppo eval`, `probe`
and `--resume`) loads base and adapter from the adapter directory alone.

A run that trains an adapter given as --model on keeps that adapter, frozen, as its KL reference:
a second peft adapter named REFERENCE in the same model (`add_reference_adapter`), active only
inside `reference_adapter`, and never saved (`save_model`).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

PEFT_INSTALL = 'pip install "gppo[peft]"'
ADAPTER_CONFIG = "adapter_config.json"
ALL_LINEAR = "all-linear"  # peft's name for every Linear of the decoder, the output layer excepted
REFERENCE = "reference"  # the frozen adapter of the KL reference, beside the trained one


class AdapterError(ValueError):
    """An adapter that cannot be built or loaded; the message names the setting and the fix."""


@dataclass(frozen=True)
class LoraOptions:
    """TRL's ModelConfig names: rank r, alpha (scaling s = alpha / r), dropout on the adapter's
    input, the target layers ("all-linear" or the names of Linear modules, e.g. q_proj v_proj)."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]


def require_peft():
    """The peft module, or an AdapterError with the install line."""
    try:
        import peft
    except ImportError:
        raise AdapterError(f"--use_peft needs the peft library, which is not installed: {PEFT_INSTALL}") from None
    return peft


def linear_layer_names(model) -> list[str]:
    """The distinct last names of the model's Linear layers that LoRA can target (the output layer
    excepted), e.g. ['down_proj', 'gate_proj', 'k_proj', ...]."""
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    )


def add_adapter(model, options: LoraOptions, seed: int):
    """`model` wrapped by peft with a fresh LoRA adapter (A drawn from a generator seeded by `seed`,
    B = 0); only the adapter requires gradients."""
    peft = require_peft()
    targets = list(options.target_modules)
    if targets != [ALL_LINEAR]:
        names = linear_layer_names(model)
        unknown = [t for t in targets if t not in names]
        if ALL_LINEAR in targets or unknown:
            raise AdapterError(
                f"--lora_target_modules {' '.join(targets)}: {', '.join(unknown or [ALL_LINEAR])} "
                f"{'is' if len(unknown or [1]) == 1 else 'are'} not among this model's linear layers "
                f"({' '.join(names)}); give some of these, or {ALL_LINEAR} alone"
            )
    config = peft.LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), _peft_deprecations_hidden():
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


@contextlib.contextmanager
def _peft_deprecations_hidden():
    """peft reads transformers' deprecated `is_gradient_checkpointing`: a FutureWarning for peft to fix."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter directory needs (its adapter_config.json's base_model_name_or_path)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        base = json.loads(file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise AdapterError(f"{file} is not readable JSON ({err}); save the adapter again") from None
    if not base:
        raise AdapterError(
            f"{file} names no base model (base_model_name_or_path); set it to the base model's "
            "directory, .gguf file or name"
        )
    return base


def set_adapter_base(model, base: str | Path) -> None:
    """Record `base` (a name, or a path made absolute) as the base the saved adapter needs."""
    base = str(Path(base).resolve()) if Path(base).exists() else str(base)
    for config in model.peft_config.values():
        config.base_model_name_or_path = base


def adapter_base_of(model) -> str:
    """The base an adapted model's adapter was recorded against (`set_adapter_base`)."""
    return next(iter(model.peft_config.values())).base_model_name_or_path


def load_adapter(base_model, path: str | Path, trainable: bool = False):
    """`base_model` with the adapter saved in `path` (trainable: its A and B require gradients)."""
    peft = require_peft()
    try:
        with _peft_deprecations_hidden():
            return peft.PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)
    except Exception as err:  # a truncated or foreign file surfaces as OSError, ValueError, KeyError, ...
        raise AdapterError(f"cannot load the adapter in {str(path)!r}: {type(err).__name__}: {err}") from None


def add_reference_adapter(model, path: str | Path) -> None:
    """Load the adapter saved in `path` into the adapted `model` once more, frozen and inactive, as
    REFERENCE (adapter-sized: the base is shared); `reference_adapter` computes under it."""
    require_peft()
    try:
        with _peft_deprecations_hidden():
            model.load_adapter(str(path), adapter_name=REFERENCE, is_trainable=False, torch_device="cpu")
    except Exception as err:  # as in load_adapter
        raise AdapterError(f"cannot load the adapter in {str(path)!r}: {type(err).__name__}: {err}") from None


@contextlib.contextmanager
def reference_adapter(model):
    """`model` computing with its REFERENCE adapter instead of the trained one; on exit the trained
    adapter is active again and every parameter's requires_grad is as before (peft's set_adapter
    changes them)."""
    trained = model.active_adapter
    requires_grad = [p.requires_grad for p in model.parameters()]
    model.set_adapter(REFERENCE, inference_mode=True)
    try:
        yield model
    finally:
        model.set_adapter(trained)
        for p, flag in zip(model.parameters(), requires_grad):
            p.requires_grad_(flag)


def save_model(model, directory: str | Path) -> None:
    """`model.save_pretrained(directory)`; of an adapted model its active (trained) adapter alone, not
    the REFERENCE, which peft would write to a subfolder."""
    if is_adapted(model):
        model.save_pretrained(directory, selected_adapters=[model.active_adapter])
    else:
        model.save_pretrained(directory)


def is_adapted(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter named `name` is a LoRA adapter's (A or B), not the base's."""
    return ".lora_" in name


def adapter_parameters(model) -> int:
    """Number of trainable (adapter) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def adapter_rank(model) -> int:
    """The rank r of the model's (active) adapter."""
    return max(config.r for config in model.peft_config.values())


@torch.no_grad()
def merged_parameters(model):
    """(name, tensor) of every parameter of the base, under the base's own names, with each LoRA
    layer's weight merged: W + s B A (peft's `get_delta_weight`), summed in float32 (so that a
    bfloat16 base is not rounded twice); the model itself is left as it is. What a weight reload
    into an engine that holds the base alone needs."""
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if is_adapter_parameter(name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if not owner:
            yield name, p.detach()
            continue
        layer = base.get_submodule(owner)
        merged = p.detach().float()
        if leaf == "weight":
            for adapter in layer.active_adapters:
                merged = merged + layer.get_delta_weight(adapter).float()
        yield f"{owner}.{leaf}", merged
