import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("GPPO_TEST_THREADS", "2")))


def save_embedded_model(path, hidden: int = 32, heads: int = 2):
    """Save a 1-layer embedded Qwen2 of this width with the character tokenizer to `path`."""
    from gppo.models.embedded import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden=hidden, layers=1, heads=heads).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


VERL_CONFIG_DIR = Path(__file__).resolve().parents[1] / "examples" / "verl" / "config"


def compose_verl_example(*overrides, name="gppo_trainer"):
    """Compose examples/verl/config/<name> as `python -m verl.trainer.main_ppo --config-dir=examples/verl/config`
    does (verl's configs on hydra's search path), with micro-batches of 1 unless `overrides` set them."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(
            config_name=name,
            overrides=[
                "hydra.searchpath=[pkg://verl.trainer.config]",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                *overrides,
            ],
        )


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    """A saved 1-layer, 32-wide embedded Qwen2 with the character tokenizer (seconds to train on)."""
    return save_embedded_model(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The GGUF file of `--model smollm2` (NAMED_MODELS, found without importing the package, which
    needs `llm`); skips, naming the install line, when a package it needs or the file is absent."""
    import importlib.util

    from gppo.models.loading import NAMED_MODELS, ModelNotFoundError, named_model_path

    entry = NAMED_MODELS["smollm2"]
    if any(importlib.util.find_spec(name) is None for name in entry.requires):
        pytest.skip(f"the real-model tests need `{entry.install}`")
    try:
        return named_model_path("smollm2")
    except ModelNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory):
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory: the GGUF is loaded once through
    gppo's loader (from the folder holding it) and saved as a run checkpoint would be."""
    from gppo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(smollm2_gguf.parent, dtype=torch.float32)
    path = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file (skipped without it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
