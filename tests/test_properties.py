"""Property tests on random batches: for every preset and divergence, the loss and its gradient
are finite, masks are {0,1}, fractions lie in [0,1] and estimates are >= 0."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gppo

PRESET_NAMES = sorted(gppo.PRESETS)
MASK_PRESETS = ["dppo-binary-tv", "dppo-topk-kl", "trm"]


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    V, K = 12, draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.0, 0.1, 1.0, 4.0]))
    gen = torch.Generator().manual_seed(seed)
    log_mu = torch.log_softmax(draw(st.sampled_from([0.5, 3.0, 8.0])) * torch.randn(B, T, V, generator=gen), -1)
    log_pi = torch.log_softmax(log_mu + spread * torch.randn(B, T, V, generator=gen), -1)
    log_old = torch.log_softmax(log_mu + spread / 2 * torch.randn(B, T, V, generator=gen), -1)  # anchor='old'
    ids = torch.multinomial(log_mu.exp().view(-1, V), 1, generator=gen).view(B, T)
    mask = (torch.rand(B, T, generator=gen) < 0.8).float()
    mask[0, 0] = 1.0
    per_token = draw(st.booleans())
    adv = torch.randn((B, T) if per_token else (B,), generator=gen) * draw(st.sampled_from([0.0, 1.0, 100.0]))
    top_logq, top_ids = log_mu.topk(K, -1)
    logits = log_pi.clone().requires_grad_(True)
    log_pi_graph = torch.log_softmax(logits, -1)
    return gppo.TokenBatch(
        logp=log_pi_graph.gather(-1, ids[..., None])[..., 0],
        logp_behavior=log_mu.gather(-1, ids[..., None])[..., 0],
        advantages=adv,
        mask=mask,
        token_ids=ids,
        topk_ids=top_ids,
        topk_logp_behavior=top_logq,
        topk_logp=log_pi_graph.gather(-1, top_ids).detach(),
        logits=logits,
        logp_behavior_full=log_mu,
        logp_ref=log_mu.gather(-1, ids[..., None])[..., 0],
        logp_old=log_old.gather(-1, ids[..., None])[..., 0],
    ), logits


@settings(max_examples=60, deadline=None)
@given(data=batches(), name=st.sampled_from(PRESET_NAMES), kl=st.sampled_from([0.0, 0.1]))
def test_every_preset_gives_finite_loss_gradient_and_bounded_metrics(data, name, kl):
    batch, logits = data
    loss, metrics = gppo.policy_loss(batch, gppo.preset(name, kl_coef=kl))
    assert torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all()
    for key, value in metrics.items():
        assert math.isfinite(value), key
        if "frac" in key:
            assert 0.0 <= value <= 1.0, key
    assert metrics["ratio/min"] <= metrics["ratio/mean"] <= metrics["ratio/max"]


@settings(max_examples=40, deadline=None)
@given(
    data=batches(),
    divergence=st.sampled_from(sorted(gppo.DIVERGENCES)),
    estimator=st.sampled_from(sorted(gppo.ESTIMATORS)),
    name=st.sampled_from(MASK_PRESETS),
)
def test_every_divergence_estimator_pair_runs_with_mask_rules(data, divergence, estimator, name):
    batch, logits = data
    cfg = gppo.preset(name, divergence=divergence, estimator=estimator)
    est = gppo.estimate(cfg, batch)
    assert torch.isfinite(est).all() and (est >= 0).all()
    assert (est[batch.mask == 0] == 0).all()
    loss, metrics = gppo.policy_loss(batch, cfg)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert 0.0 <= metrics["masked_frac"] <= 1.0
