import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("GPPO_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    """A saved 1-layer, 32-wide embedded Qwen2 with the character tokenizer (seconds to train on)."""
    from gppo.models.embedded import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("micro")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
