"""The training forward (trainer/batch.py) against the unchunked computation it replaced.

The reference, written here and nowhere in the product: the model's logits at every position,
float32, divided by the temperature, masked to the top-p nucleus, log_softmax over [N, T, V], and a
TokenBatch that carries those logits and the anchors' full distributions. The product computes the
same per-token quantities from the hidden states at the completion positions, chunk by chunk, with
one forward per distinct prompt. Loss, metrics and gradients must agree in float32.
"""

import dataclasses

import pytest
import torch

import gppo
from gppo.models.embedded import build_model, build_tokenizer
from gppo.models.forward import (
    ForwardOptions,
    completion_hidden_states,
    enable_activation_checkpointing,
    policy_outputs,
)
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.trainer.batch import rollout_from_generations, token_batch

PROMPTS = ["1+2=", "345+678=", "9+99="]  # of different lengths: left padding


@pytest.fixture(scope="module")
def micro():
    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=0, hidden=32, layers=2, heads=2).float().eval(), tokenizer


def make_rollout(micro, temperature=0.8, top_k=5, top_p=1.0, n=3, max_new_tokens=6, seed=1):
    model, tokenizer = micro
    params = SamplingParams(
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        n=n,
        top_k_logprobs=top_k,
        seed=seed,
        top_p=top_p,
        record_kept_ids=top_p < 1,
    )
    gens = HFEngine(model, tokenizer).generate(PROMPTS, params)
    advantages = torch.linspace(-1.5, 1.5, len(gens))
    return rollout_from_generations(gens, advantages, tokenizer.pad_token_id, top_k)


def reference_log_probs(model, rollout, temperature):
    """log_softmax of the full-position logits / T, masked to S_t for top-p rollouts: [N, T, V]."""
    position_ids = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=position_ids)
    P, T = rollout.prompt_length, rollout.token_ids.shape[1]
    logits = out.logits[:, P - 1 : P - 1 + T].float() / temperature
    if rollout.kept_sizes is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for row, ids in enumerate(rollout.kept_ids):
            positions = torch.repeat_interleave(torch.arange(T), rollout.kept_sizes[row])
            keep[row, positions, ids] = True
        logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return logits, torch.log_softmax(logits, -1)


def reference_batch(model, rollout, temperature):
    logits, log_probs = reference_log_probs(model, rollout, temperature)
    logp = log_probs.gather(-1, rollout.token_ids[..., None])[..., 0]
    topk = None if rollout.topk_ids is None else log_probs.gather(-1, rollout.topk_ids)
    return gppo.TokenBatch(
        logp=logp,
        logp_behavior=rollout.logp_behavior,
        advantages=rollout.advantages,
        mask=rollout.response_mask,
        logp_old=rollout.logp_old,
        token_ids=rollout.token_ids,
        topk_ids=rollout.topk_ids,
        topk_logp_behavior=rollout.topk_logp_behavior,
        topk_logp=topk,
        topk_logp_old=rollout.topk_logp_old,
        logits=logits,
        logp_behavior_full=rollout.logp_behavior_full,
        logp_old_full=rollout.logp_old_full,
        logp_ref=rollout.logp_ref,
        logp_ref_full=rollout.logp_ref_full,
    )


def assert_grads_close(got: dict, expected: dict, rel=1e-5):
    """Each parameter's gradient within rel x its largest entry (float32 sums in another order)."""
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=rel * value.abs().max().item() + 1e-9, msg=name)


def loss_and_grads(model, batch_of, config):
    model.zero_grad(set_to_none=True)
    loss, metrics = gppo.policy_loss(batch_of(), config)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model, reference, chunked, config):
    loss_a, metrics_a, grads_a = loss_and_grads(model, reference, config)
    loss_b, metrics_b, grads_b = loss_and_grads(model, chunked, config)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads_b, grads_a)
    assert metrics_a.keys() == metrics_b.keys()
    for name in metrics_a:
        assert metrics_b[name] == pytest.approx(metrics_a[name], rel=1e-4, abs=1e-6), name


def with_anchor_distributions(model, rollout, temperature, other_seed=7):
    """The rollout with pi_old's log-probs, mu's and a reference's full distributions from other
    weights (so that every ratio, estimate and KL is away from its trivial value)."""
    tokenizer = build_tokenizer()
    other = build_model(tokenizer, seed=other_seed, hidden=32, layers=2, heads=2).float().eval()
    ref = build_model(tokenizer, seed=other_seed + 1, hidden=32, layers=2, heads=2).float().eval()
    with torch.no_grad():
        _, mu = reference_log_probs(other, rollout, temperature)
        _, ref_full = reference_log_probs(ref, rollout, temperature)
        _, old = reference_log_probs(model, rollout, temperature)
    valid = rollout.response_mask.bool()[..., None]
    return dataclasses.replace(
        rollout,
        logp_behavior=mu.gather(-1, rollout.token_ids[..., None])[..., 0],
        topk_logp_behavior=mu.gather(-1, rollout.topk_ids),
        logp_behavior_full=torch.where(valid, mu, 0.0),
        logp_old=old.gather(-1, rollout.token_ids[..., None])[..., 0] + 0.05,
        topk_logp_old=old.gather(-1, rollout.topk_ids),
        logp_old_full=torch.where(valid, old, 0.0),
        logp_ref=ref_full.gather(-1, rollout.token_ids[..., None])[..., 0],
        logp_ref_full=torch.where(valid, ref_full, 0.0),
    )


@pytest.mark.parametrize("name", sorted(gppo.PRESETS))
def test_every_preset_matches_the_unchunked_forward(micro, name):
    model, _ = micro
    rollout = with_anchor_distributions(model, make_rollout(micro, top_k=20), 0.8)
    config = gppo.preset(name)
    options = ForwardOptions(chunk_size=4)  # several chunks, the last one partial

    def chunked():
        return token_batch(rollout, policy_outputs(model, rollout, 0.8, config, entropy=True, options=options))

    assert_same(model, lambda: reference_batch(model, rollout, 0.8), chunked, config)


@pytest.mark.parametrize(
    "changes",
    [
        dict(estimator="full"),
        dict(estimator="full", anchor="old"),
        dict(estimator="topp", top_p=0.7),
        dict(kl_coef=0.2, kl_estimator="full"),
        dict(kl_coef=0.2, kl_estimator="k3"),
        dict(divergence="chi2", estimator="full", kl_coef=0.1, kl_estimator="full"),
    ],
)
def test_full_vocabulary_estimates_and_kl_match_the_unchunked_forward(micro, changes):
    model, _ = micro
    rollout = with_anchor_distributions(model, make_rollout(micro, top_k=20), 0.8)
    config = gppo.preset("dppo-binary-tv", **changes)

    def chunked():
        return token_batch(
            rollout, policy_outputs(model, rollout, 0.8, config, entropy=True, options=ForwardOptions(chunk_size=5))
        )

    assert_same(model, lambda: reference_batch(model, rollout, 0.8), chunked, config)


def test_top_p_rollout_matches_the_unchunked_forward(micro):
    model, _ = micro
    rollout = with_anchor_distributions(model, make_rollout(micro, top_k=20, top_p=0.6), 0.8)
    config = gppo.preset("dppo-topk-kl", top_k=20, kl_coef=0.1, kl_estimator="full")

    def chunked():
        return token_batch(
            rollout, policy_outputs(model, rollout, 0.8, config, entropy=True, options=ForwardOptions(chunk_size=3))
        )

    assert_same(model, lambda: reference_batch(model, rollout, 0.8), chunked, config)


@pytest.mark.parametrize("max_new_tokens", [1, 6])
def test_shared_prompt_forward_equals_the_whole_forward(micro, max_new_tokens):
    """One forward per distinct prompt, its key/value cache expanded to its completions: the same
    hidden states and the same parameter gradients as one forward of every whole sequence."""
    model, _ = micro
    rollout = make_rollout(micro, max_new_tokens=max_new_tokens)
    rollout = rollout.select(torch.tensor([0, 4, 1, 2, 7, 8]))  # groups broken up and reordered
    valid = rollout.response_mask.bool()
    weights = torch.randn(*valid.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights = weights * valid[..., None]  # padding positions hold anything

    def hidden_and_grads(share):
        model.zero_grad(set_to_none=True)
        hidden = completion_hidden_states(model, rollout, share_prompt=share)
        (hidden * weights).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = hidden_and_grads(False)
    shared, shared_grads = hidden_and_grads(True)
    torch.testing.assert_close(shared[valid], whole[valid], rtol=1e-5, atol=1e-6)
    assert_grads_close(shared_grads, whole_grads)


def batch_with(model, rollout, config, **options):
    """A function building the TokenBatch of `rollout` with these ForwardOptions."""
    return lambda: token_batch(rollout, policy_outputs(model, rollout, 0.8, config, options=ForwardOptions(**options)))


def test_gradient_checkpointing_gives_the_same_gradients(micro):
    model, _ = micro
    rollout = make_rollout(micro)
    config = gppo.preset("dppo-topk-tv", top_k=5)

    def batch(share):
        return batch_with(model, rollout, config, share_prompt=share)

    model.train()
    try:
        plain = loss_and_grads(model, batch(True), config)
        enable_activation_checkpointing(model)
        checkpointed = loss_and_grads(model, batch(False), config)
        with pytest.raises(ValueError, match="share_prompt"):  # the layers would run without the prompt's cache
            batch(True)()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=1e-6, atol=1e-7)
    assert_grads_close(checkpointed[2], plain[2])


def test_bfloat16_autocast_keeps_float32_weights_and_gradients(micro):
    """Mixed precision: the forward runs in bfloat16, the weights and their gradients stay float32,
    and the loss and gradient stay within bfloat16's resolution of the float32 ones."""
    model, _ = micro
    rollout = make_rollout(micro)
    config = gppo.preset("dppo-topk-tv", top_k=5)
    full_loss, _, full_grads = loss_and_grads(model, batch_with(model, rollout, config), config)
    mixed_loss, _, mixed_grads = loss_and_grads(
        model, batch_with(model, rollout, config, autocast=torch.bfloat16), config
    )
    assert all(g.dtype == torch.float32 for g in mixed_grads.values())
    assert mixed_loss.dtype == torch.float32
    torch.testing.assert_close(mixed_loss, full_loss, rtol=0.05, atol=0.02)
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])
    cosine = torch.nn.functional.cosine_similarity(flat(mixed_grads), flat(full_grads), dim=0)
    assert cosine > 0.99
    assert not torch.equal(flat(mixed_grads), flat(full_grads))  # the forward really ran in bfloat16


def test_a_model_whose_logits_are_not_its_output_layer_is_refused(micro):
    model, _ = micro
    rollout = make_rollout(micro)
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            policy_outputs(model, rollout, 0.8)
    finally:
        model.config.final_logit_softcapping = None
