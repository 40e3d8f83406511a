import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
import torch

from gppo.models.embedded import MARKER, build_model, build_tokenizer
from gppo.models.loading import load_model_and_tokenizer, load_tokenizer

torch.set_num_threads(1)

TEXTS = ["123+456=9750", "2 3 7 -> 27:3*7+2*3", "make 22 from 3 5 7:  (3+5)*7 ", " a b?\n"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedded")
    tokenizer = build_tokenizer()
    build_model(tokenizer, hidden=32, layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def test_tokenizer_is_char_level_and_decodes_exactly():
    tok = build_tokenizer()
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>" and tok.padding_side == "left"
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""


def test_round_trip_after_save_and_load(saved):
    path, tok = saved
    model, loaded = load_model_and_tokenizer(path)
    assert json.loads((path / "tokenizer_config.json").read_text())[MARKER] is True
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (
        tok.eos_token_id,
        tok.pad_token_id,
        "left",
    )
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training


def test_default_model_size():
    tok = build_tokenizer()
    model = build_model(tok)
    n = sum(p.numel() for p in model.parameters())
    assert 0.45e6 < n < 0.6e6
    assert model.config.tie_word_embeddings and model.config.intermediate_size == 4 * 128
    assert model.config.vocab_size == len(tok)


def test_same_seed_same_weights():
    tok = build_tokenizer()
    a, b = build_model(tok, seed=3, hidden=32, layers=1), build_model(tok, seed=3, hidden=32, layers=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_tokenizer_without_eos_is_a_clear_error(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("eos_token")
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer(tmp_path)


def test_missing_pad_falls_back_to_eos(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("pad_token")
    cfg_file.write_text(json.dumps(cfg))
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id


def test_warm_start_saves_a_loadable_checkpoint(tmp_path):
    from gppo.commands.warmstart import warm_start

    out = warm_start("countdown", tmp_path / "ws", steps=2, batch_size=4, eval_problems=0, log_every=1)
    report = json.loads((out / "warmstart.json").read_text())
    assert report["steps"] == 2 and report["task"] == "countdown"
    model, tok = load_model_and_tokenizer(out)
    assert tok("1 2 -> 3:")["input_ids"] == build_tokenizer()("1 2 -> 3:")["input_ids"]


@pytest.mark.parametrize("task_name, low, high", [("addition", 0.3, 0.6), ("countdown", 0.02, 0.35)])
def test_shipped_warm_start_is_an_imperfect_teacher(task_name, low, high):
    from gppo.models.assets import ASSETS, embedded_checkpoint
    from gppo.rollout.base import SamplingParams
    from gppo.rollout.hf import HFEngine
    from gppo.tasks import get_task, heldout_problems

    path = ASSETS / task_name
    assert (path / "config.json").exists(), "shipped warm start missing: regenerate it (gppo warmstart)"
    assert embedded_checkpoint(task_name) == path
    model, tok = load_model_and_tokenizer(path)
    task, problems = get_task(task_name), heldout_problems(get_task(task_name), 256)
    gens = HFEngine(model, tok).generate([p.prompt for p in problems], SamplingParams(max_new_tokens=32, seed=0))
    acc = sum(task.score(p, g.text) for p, g in zip(problems, gens)) / len(problems)
    assert low < acc < high  # sampled accuracy: learned the task's teacher, far from solved
    assert all(g.finish_reason == "stop" for g in gens)


def test_embedded_checkpoint_rejects_unknown_task():
    from gppo.models.assets import embedded_checkpoint

    with pytest.raises(ValueError, match="did you mean 'addition'"):
        embedded_checkpoint("adition")
