"""Trust-region rules and presets: every seed method against an independent reference, on loss
values and on gradients with respect to logp; the claimed equivalences; aggregation; KL penalty."""

import math

import pytest
import torch

import gppo
from tests import reference as ref


def random_batch(B=6, T=7, V=30, K=5, seed=0, spread=0.4, token_advantages=False):
    """A batch sampled from mu with a nearby pi, ragged response lengths, logp a leaf tensor."""
    gen = torch.Generator().manual_seed(seed)
    logits_mu = 2 * torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    log_mu = torch.log_softmax(logits_mu, -1)
    log_pi = torch.log_softmax(logits_mu + spread * torch.randn(B, T, V, generator=gen, dtype=torch.float64), -1)
    ids = torch.multinomial(log_mu.exp().view(-1, V), 1, generator=gen).view(B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv = torch.randn((B, T) if token_advantages else (B,), generator=gen, dtype=torch.float64)
    top_logq, top_ids = log_mu.topk(K, -1)
    batch = gppo.TokenBatch(
        logp=log_pi.gather(-1, ids[..., None])[..., 0].clone().requires_grad_(True),
        logp_behavior=log_mu.gather(-1, ids[..., None])[..., 0],
        advantages=adv,
        mask=mask,
        token_ids=ids,
        topk_ids=top_ids,
        topk_logp_behavior=top_logq,
        topk_logp=log_pi.gather(-1, top_ids),
    )
    return batch, log_pi, log_mu


def loss_and_grad(batch, config):
    loss, metrics = gppo.policy_loss(batch, config)
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return loss, grad, metrics


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


def assert_same(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-9)


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_matches_reference_and_equals_tv_sample_mask(seed):
    batch, _, _ = random_batch(seed=seed)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("ppo"))
    expected = ref.ppo_clip_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 0.2)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    # PPO = GPPO(tv, sample, mask, delta = eps / 2) on gradients
    _, mask_grad, _ = loss_and_grad(batch, gppo.preset("ppo", rule="mask"))
    assert_same(grad, mask_grad)
    assert (grad != 0).any() and (grad == 0).any()  # both clipped and free tokens were exercised


@pytest.mark.parametrize("seed", SEEDS)
def test_dual_clip(seed):
    batch, _, _ = random_batch(seed=seed, spread=1.5)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("ppo", dual_clip=1.5))
    expected = ref.ppo_clip_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 0.2, 1.5)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    _, mask_grad, _ = loss_and_grad(batch, gppo.preset("ppo", rule="mask", dual_clip=1.5))
    assert_same(grad, mask_grad)
    plain = grad_of(ref.ppo_clip_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 0.2), batch)
    assert not torch.equal(plain, grad)  # the dual clip changed something in this batch


@pytest.mark.parametrize("seed", SEEDS)
def test_dapo_asymmetric(seed):
    batch, _, _ = random_batch(seed=seed)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("dapo"))
    expected = ref.ppo_clip_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 0.28)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    _, mask_grad, _ = loss_and_grad(batch, gppo.preset("dapo", rule="mask"))
    assert_same(grad, mask_grad)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,binary_fn", [("dppo-binary-tv", ref.binary_tv), ("dppo-binary-kl", ref.binary_kl)])
@pytest.mark.parametrize("cap", [None, 1.3])
def test_dppo_binary(seed, name, binary_fn, cap):
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    cfg = gppo.preset(name, truncation=cap)
    loss, grad, _ = loss_and_grad(batch, cfg)
    d = binary_fn(batch.logp.detach().exp(), batch.logp_behavior.exp())
    expected = ref.dppo_loss(
        batch.logp, batch.logp_behavior, batch.advantages, batch.mask, d, cfg.delta_low, cfg.delta_high, cap
    )
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,div_name", [("dppo-topk-tv", "tv"), ("dppo-topk-kl", "kl")])
def test_dppo_topk(seed, name, div_name):
    batch, log_pi, log_mu = random_batch(seed=seed, spread=1.0, K=5)
    cfg = gppo.preset(name, top_k=5)
    loss, grad, _ = loss_and_grad(batch, cfg)
    B, T = batch.mask.shape
    d = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            top = set(batch.topk_ids[i, t].tolist()) | {int(batch.token_ids[i, t])}
            d[i, t] = ref.partition_divergence(div_name, log_pi[i, t].exp(), log_mu[i, t].exp(), [{j} for j in top])
    expected = ref.dppo_loss(
        batch.logp, batch.logp_behavior, batch.advantages, batch.mask, d, cfg.delta_low, cfg.delta_high
    )
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
def test_ripo_is_clip_to_sqrt_delta_over_q(seed):
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("ripo"))
    q = batch.logp_behavior.exp()
    width = torch.sqrt(0.05 / q)
    r = torch.exp(batch.logp - batch.logp_behavior)
    adv = batch.advantages[:, None]
    surrogate = torch.min(r * adv, torch.max(torch.min(r, 1 + width), (1 - width).clamp(min=0)) * adv)
    expected = -(surrogate * batch.mask).sum() / batch.mask.sum()
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    # and the chi^2-cell mask has the same gradient
    _, mask_grad, _ = loss_and_grad(batch, gppo.preset("ripo", rule="mask"))
    assert_same(grad, mask_grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo(seed):
    batch, _, _ = random_batch(seed=seed, spread=0.0)
    with torch.no_grad():  # sequence ratios within a few 1e-4 of 1, so that both sides are exercised
        batch.logp += 6e-4 * torch.randn(
            batch.logp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("gspo"))
    expected = ref.gspo_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 3e-4, 4e-4)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert 0 < metrics["masked_frac"] < 1


@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo(seed):
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("gmpo"))
    expected = ref.gmpo_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.4)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,cap", [("cispo", 5.0), ("pg-is", 10.0)])  # pg-is: DPPO's PG-IS baseline
def test_truncated_importance_weight_presets(seed, name, cap):
    batch, _, _ = random_batch(seed=seed, spread=3.0)
    loss, grad, metrics = loss_and_grad(batch, gppo.preset(name))
    expected = ref.cispo_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, cap)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert "masked_frac" not in metrics and 0 < metrics["truncated_frac"] < 1


@pytest.mark.parametrize("seed", SEEDS)
def test_minirl(seed):
    """MiniRL: PPO's clip (eps 0.2) on pi / pi_old, times sg[min(pi_old / mu, 10)]."""
    batch, _, _ = random_batch(seed=seed, spread=0.5)
    noise = torch.randn(batch.logp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    batch.logp_old = (batch.logp_behavior + 3.0 * noise).clamp(max=0.0)  # some pi_old / mu above the cap
    assert (torch.exp(batch.logp_old - batch.logp_behavior) > 10).any()
    loss, grad, _ = loss_and_grad(batch, gppo.preset("minirl"))
    expected = ref.decoupled_ppo_loss(
        batch.logp, batch.logp_old, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 10.0
    )
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo(seed):
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("sapo"))
    expected = ref.sapo_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 1.0, 1.05)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
def test_dcpo(seed):
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("dcpo"))
    expected = ref.dcpo_loss(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, 0.16, 0.2)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


def test_dcpo_upper_bound_is_capped_at_ten():
    """DCPO's code caps hi = 0.5 + 0.5 sqrt(1 + 4 eps / q) at 10: at q = 1e-4, eps = 0.2 the
    formula gives 45.2, so r = 20 with A > 0 is clipped (zero gradient) and r = 9 is not."""
    logq = torch.full((1, 2), math.log(1e-4), dtype=torch.float64)
    logp = (logq + torch.log(torch.tensor([[20.0, 9.0]], dtype=torch.float64))).requires_grad_(True)
    batch = gppo.TokenBatch(
        logp=logp, logp_behavior=logq, advantages=torch.tensor([1.0], dtype=torch.float64), mask=torch.ones(1, 2)
    )
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("dcpo"))
    assert grad[0, 0] == 0 and grad[0, 1] == pytest.approx(-9.0 / 2)
    assert loss.item() == pytest.approx(-(10.0 + 9.0) / 2)
    assert metrics["masked_frac"] == 0.5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_trm_sequence_mask(seed, reduce):
    batch, _, _ = random_batch(seed=seed, spread=0.5)
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("trm", seq_reduce=reduce))
    log_r = (batch.logp - batch.logp_behavior).detach()
    k3 = torch.exp(log_r) - 1 - log_r
    if reduce == "max":
        stat = torch.where(batch.mask.bool(), k3, -1.0).max(-1).values
    else:
        stat = (k3 * batch.mask).sum(-1) / batch.mask.sum(-1)
    keep = (stat <= 0.05).double()[:, None]
    r = torch.exp(batch.logp - batch.logp_behavior)
    expected = -(batch.advantages[:, None] * r * keep * batch.mask).sum() / batch.mask.sum()
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    dropped = ((1 - keep) * batch.mask).sum() / batch.mask.sum()
    assert metrics["masked_frac"] == pytest.approx(dropped.item())


@pytest.mark.parametrize("preset_name", ["ppo", "dppo-binary-tv", "sapo", "gspo", "gmpo"])
def test_truncation_caps_the_gradient_weight(preset_name):
    """With truncation C, each token's (or sequence's) gradient weight x becomes min(x, C)."""
    batch, _, _ = random_batch(seed=4, spread=1.0 if preset_name != "gspo" else 0.3)
    cap = 1.02 if preset_name == "gspo" else 1.05
    _, free, _ = loss_and_grad(batch, gppo.preset(preset_name))
    _, capped, metrics = loss_and_grad(batch, gppo.preset(preset_name, truncation=cap))
    assert metrics["truncated_frac"] > 0
    log_r = (batch.logp - batch.logp_behavior).detach()
    if preset_name == "gspo":
        weight = torch.exp((log_r * batch.mask).sum(-1) / batch.mask.sum(-1))[:, None]
    elif preset_name == "gmpo":
        sign = torch.sign(batch.advantages)[:, None]
        clipped = sign * torch.min(sign * log_r, sign * torch.clamp(log_r, -0.4, 0.4))
        weight = torch.exp((clipped * batch.mask).sum(-1) / batch.mask.sum(-1))[:, None]
    else:
        weight = torch.exp(log_r)
    assert (weight.expand_as(log_r)[batch.mask.bool()] > cap).any()
    assert_same(capped, free * torch.clamp(weight, max=cap) / weight)


def test_anchor_old_uses_the_recomputed_policy():
    batch, _, _ = random_batch(seed=5, spread=1.0)
    old = batch.logp_behavior + 0.1 * torch.randn(
        batch.logp.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    swapped = gppo.TokenBatch(logp=batch.logp, logp_behavior=old, advantages=batch.advantages, mask=batch.mask)
    batch.logp_old = old
    for name in ("ppo", "dppo-binary-kl", "gmpo"):
        a, ga, _ = loss_and_grad(batch, gppo.preset(name, anchor="old"))
        b, gb, _ = loss_and_grad(swapped, gppo.preset(name))
        assert_same(a, b)
        assert_same(ga, gb)


def test_behavior_weight_cap_is_truncated_importance_sampling():
    batch, _, _ = random_batch(seed=6, spread=0.5)
    batch.logp_old = batch.logp_behavior + 0.3 * torch.randn(
        batch.logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    loss, grad, _ = loss_and_grad(batch, gppo.preset("ppo", anchor="old", behavior_weight_cap=1.1))
    expected = ref.decoupled_ppo_loss(
        batch.logp, batch.logp_old, batch.logp_behavior, batch.advantages, batch.mask, 0.2, 1.1
    )
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    with pytest.raises(gppo.GPPOConfigError, match="anchor='old'"):
        gppo.preset("ppo", behavior_weight_cap=2.0)


@pytest.mark.parametrize("preset_name", list(gppo.PRESETS))
def test_blocked_tokens_have_zero_gradient(preset_name):
    batch, _, _ = random_batch(seed=7, spread=1.0, token_advantages=True)
    cfg = gppo.preset(preset_name)
    if cfg.anchor == "old":  # minirl: a recomputed pi_old near mu
        batch.logp_old = (batch.logp_behavior + 0.05).clamp(max=0.0)
    loss, grad, metrics = loss_and_grad(batch, cfg)
    assert torch.isfinite(loss)
    assert (grad[batch.mask == 0] == 0).all()  # padding never receives gradient
    # (a kl_tau penalty acts on blocked tokens too: prime-dppo-kl's are checked in test_new_presets)
    if "masked_frac" in metrics and cfg.rule in ("mask", "clip", "seq-mask", "band", "clip-cov") and cfg.kl_tau is None:
        zero = ((grad == 0) & (batch.mask == 1)).sum() / batch.mask.sum()
        assert metrics["masked_frac"] == pytest.approx(zero.item())


def test_aggregation_modes_and_global_normalisers():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])
    assert gppo.aggregate(values, mask, "token-mean").item() == pytest.approx(21 / 6)
    assert gppo.aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4 + 5.5) / 3)
    assert gppo.aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(21 / 3)
    assert gppo.aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(21 / (3 * 3))
    assert gppo.aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(21 / 30)
    # micro-batches with the global counts sum to the full-batch value
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        whole = gppo.aggregate(values, mask, mode)
        parts = sum(
            gppo.aggregate(values[s], mask[s], mode, norm_length=3, num_tokens=6, num_sequences=3)
            for s in (slice(0, 1), slice(1, 3))
        )
        assert parts.item() == pytest.approx(whole.item())


def test_policy_loss_with_global_counts_equals_whole_batch_gradient():
    batch, _, _ = random_batch(seed=8)
    cfg = gppo.preset("grpo")
    whole, grad, _ = loss_and_grad(batch, cfg)
    halves = []
    for part in (slice(0, 2), slice(2, 6)):
        sub = gppo.TokenBatch(
            logp=batch.logp[part],
            logp_behavior=batch.logp_behavior[part],
            advantages=batch.advantages[part],
            mask=batch.mask[part],
        )
        halves.append(gppo.policy_loss(sub, cfg, num_tokens=batch.mask.sum(), num_sequences=6)[0])
    assert_same(halves[0] + halves[1], whole)
    assert_same(grad_of(halves[0] + halves[1], batch), grad)


def test_reference_kl_estimators():
    batch, log_pi, _ = random_batch(seed=9)
    gen = torch.Generator().manual_seed(3)
    log_ref = torch.log_softmax(log_pi + 0.3 * torch.randn(log_pi.shape, generator=gen, dtype=torch.float64), -1)
    batch.logp_ref = log_ref.gather(-1, batch.token_ids[..., None])[..., 0]
    x = (batch.logp.detach() - batch.logp_ref) * batch.mask  # padding reads as 0
    assert_same(gppo.reference_kl(batch, "k1"), x)
    assert_same(gppo.reference_kl(batch, "k2"), 0.5 * x**2)
    assert_same(gppo.reference_kl(batch, "k3"), torch.exp(-x) - 1 + x)
    logits = log_pi.clone().requires_grad_(True)
    batch.logits, batch.logp_ref_full = logits, log_ref
    exact = (log_pi.exp() * (log_pi - log_ref)).sum(-1)
    assert_same(gppo.reference_kl(batch, "full") * batch.mask, exact * batch.mask)
    # the penalty enters the loss with its coefficient and its gradient reaches logp
    base, _ = gppo.policy_loss(batch, gppo.preset("grpo"))
    with_kl, metrics = gppo.policy_loss(batch, gppo.preset("grpo", kl_coef=0.04))
    k3 = gppo.aggregate(torch.exp(-x) - 1 + x, batch.mask, "seq-mean-token-mean")
    assert_same(with_kl - base, 0.04 * k3)
    assert metrics["kl_ref"] == pytest.approx(
        ((torch.exp(-x) - 1 + x) * batch.mask).sum().item() / batch.mask.sum().item()
    )
    full_loss, _ = gppo.policy_loss(batch, gppo.preset("grpo", kl_coef=1.0, kl_estimator="full"))
    (g,) = torch.autograd.grad(full_loss, logits)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_metrics_are_split_by_advantage_sign_and_probability_bucket():
    batch, log_pi, log_mu = random_batch(B=16, T=12, V=200, seed=10, spread=2.0)
    batch.logits = log_pi
    _, metrics = gppo.policy_loss(batch, gppo.preset("ppo"))
    token_fracs = [v for k, v in metrics.items() if k.startswith("token_frac/")]
    assert sum(token_fracs) == pytest.approx(1.0)
    for key, value in metrics.items():
        if "frac" in key:
            assert 0.0 <= value <= 1.0, key
    assert {
        "masked_frac",
        "masked_frac/adv_pos",
        "masked_frac/adv_neg",
        "divergence/mean",
        "divergence/max",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "entropy",
        "loss/policy",
    } <= set(metrics)
    expected_entropy = -(log_pi.exp() * log_pi).sum(-1)[batch.mask.bool()].mean()
    assert metrics["entropy"] == pytest.approx(expected_entropy.item(), rel=1e-5)
    # each bucket's masked fraction is the share of zero-gradient tokens among its tokens
    loss, _ = gppo.policy_loss(batch, gppo.preset("ppo"))
    zero_grad = grad_of(loss, batch) == 0
    q = batch.logp_behavior.exp()
    valid = batch.mask.bool()
    edges = [
        (0, 1e-3, "q[0,0.001)"),
        (1e-3, 1e-2, "q[0.001,0.01)"),
        (1e-2, 0.1, "q[0.01,0.1)"),
        (0.1, 0.5, "q[0.1,0.5)"),
        (0.5, 1.01, "q[0.5,1]"),
    ]
    for lo, hi, name in edges:
        group = valid & (q >= lo) & (q < hi)
        if group.any():
            expected = (zero_grad & group).sum().item() / group.sum().item()
            assert metrics[f"masked_frac/{name}"] == pytest.approx(expected)
            assert metrics[f"token_frac/{name}"] == pytest.approx(group.sum().item() / valid.sum().item())
        else:
            assert f"masked_frac/{name}" not in metrics


def test_metrics_leave_out_empty_groups():
    batch, _, _ = random_batch(seed=11)
    batch.advantages = batch.advantages.abs() + 0.1
    _, metrics = gppo.policy_loss(batch, gppo.preset("ppo"))
    assert "masked_frac/adv_neg" not in metrics and "masked_frac/adv_pos" in metrics
