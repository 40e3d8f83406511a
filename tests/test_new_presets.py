"""The presets taken from verl, TRL, prime-rl and IcePop against independent references written
from their equations (tests/reference_losses.py): loss and gradient in float64, each branch of the
rule exercised; their parameters' validation. The peers' own functions are the oracles of
tests/test_verl_plugin.py and tests/test_trl_trainer.py."""

import pytest
import torch

import gppo
from tests import reference_losses as ref
from tests.test_rules import assert_same, grad_of, loss_and_grad, random_batch

SEEDS = [0, 1, 2]


def inputs(seed, spread=1.0):
    batch, _, _ = random_batch(seed=seed, spread=spread)
    return batch, (batch.logp, batch.logp_behavior, batch.advantages, batch.mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_and_dro(seed):
    batch, (logp, logq, adv, mask) = inputs(seed)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("gpg"))
    expected = ref.gpg_loss(logp, adv, mask)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    loss, grad, _ = loss_and_grad(batch, gppo.preset("dro"))
    expected = ref.dro_loss(logp, logq, adv, mask, beta=0.05)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert not torch.allclose(grad, grad_of(ref.gpg_loss(logp, adv, mask), batch))  # the penalty acts


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [2e-4, 0.1])
def test_kl_cov(seed, ratio):
    batch, (logp, logq, adv, mask) = inputs(seed)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("kl-cov", cov_ratio=ratio))
    expected = ref.kl_cov_loss(logp, logq, adv, mask, ratio, coef=0.1)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_detaches_the_drawn_candidates(seed):
    batch, (logp, logq, adv, mask) = inputs(seed)
    cfg = gppo.preset("clip-cov", cov_ratio=0.1, cov_low=0.05)
    expected, keep = ref.clip_cov_loss(logp, logq, adv, mask, 0.2, 0.1, 0.05, 5.0, seed=seed)
    torch.manual_seed(seed)
    loss, grad, metrics = loss_and_grad(batch, cfg)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    detached = (keep == 0) & (mask == 1)
    assert detached.any() and (grad[detached] == 0).all()
    assert 0 < metrics["masked_frac"] < 1
    # no candidate in the band: nothing detached, PPO's clip
    loss, grad, _ = loss_and_grad(batch, gppo.preset("clip-cov", cov_low=50.0, cov_high=60.0))
    assert_same(loss, ref.clip_cov_loss(logp, logq, adv, mask, 0.2, 2e-4, 50.0, 60.0, seed=0)[0])
    assert_same(grad, grad_of(gppo.policy_loss(batch, gppo.preset("ppo"))[0], batch))


@pytest.mark.parametrize("seed", SEEDS)
def test_vespo(seed):
    batch, (logp, logq, adv, mask) = inputs(seed, spread=0.3)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("vespo"))
    expected = ref.vespo_loss(logp, logq, adv, mask, 2.0, 3.0, 3.0, 2.0)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert (adv > 0).any() and (adv < 0).any()


@pytest.mark.parametrize("seed", SEEDS)
def test_prime_dppo_kl(seed):
    batch, (logp, logq, adv, mask) = inputs(seed, spread=1.5)
    # radii 0.05 / 0.1 instead of 0.2 / 0.2: on this vocabulary few |pi - mu| reach 0.2
    cfg = gppo.preset("prime-dppo-kl", delta_low=0.05, delta_high=0.1)
    loss, grad, metrics = loss_and_grad(batch, cfg)
    expected = ref.prime_dppo_kl_loss(logp, logq, adv, mask, 0.05, 0.1, 1e-3)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert 0 < metrics["masked_frac"] < 1


@pytest.mark.parametrize("seed", SEEDS)
def test_icepop(seed):
    batch, (logp, logq, adv, mask) = inputs(seed, spread=1.5)
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("icepop"))
    expected = ref.icepop_loss(logp, logq, adv, mask, 0.5, 5.0)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    r = (logp - logq).exp()[mask == 1]
    assert (r < 0.5).any() and (r > 5).any() and 0 < metrics["masked_frac"] < 1  # both ends of the band
    # the band drops tokens whatever the sign of A; the gradient equals the ratio form's
    _, ratio_form, _ = loss_and_grad(batch, gppo.preset("icepop", truncation=None))
    assert_same(grad, ratio_form)


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_and_luspo(seed):
    batch, (logp, logq, adv, mask) = inputs(seed, spread=0.5)
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("dr-grpo"))
    expected = ref.dr_grpo_loss(logp, logq, adv, mask, 0.2, length=logp.shape[1])
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    assert 0 < metrics["masked_frac"] < 1
    batch, (logp, logq, adv, mask) = inputs(seed, spread=0.02)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("luspo", delta_low=0.01, delta_high=0.01))
    expected = ref.luspo_loss(logp, logq, adv, mask, 0.02, 0.02)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("seed", [1, 2, 3])  # seed 0 has no A<0 sequence with mean log(mu/pi) > 0
def test_off_policy_sequence_mask(seed):
    batch, (logp, logq, adv, mask) = inputs(seed, spread=1.0)
    drift = ((logq - logp.detach()) * mask).sum(-1) / mask.sum(-1)
    threshold = 0.5 * drift[adv < 0].max().item()  # some negative sequences dropped, some kept
    loss, grad, metrics = loss_and_grad(batch, gppo.preset("grpo", off_policy_threshold=threshold))
    expected = ref.opsm_grpo_loss(logp, logq, adv, mask, 0.2, threshold)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    dropped = (adv < 0) & (drift > threshold)
    assert dropped.any() and ((adv < 0) & ~dropped).any()
    assert (grad[dropped] == 0).all()
    # on the mask rule it drops the same tokens: mask and clip agree on gradients
    mask_cfg = gppo.preset("grpo", rule="mask", off_policy_threshold=threshold)
    _, mask_grad, _ = loss_and_grad(batch, mask_cfg)
    assert_same(grad, mask_grad)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cov_ratio", 0.0, "GPPOConfig.cov_ratio must be in \\(0, 1\\]"),
        ("cov_ratio", 1.5, "GPPOConfig.cov_ratio must be in \\(0, 1\\]"),
        ("cov_low", 6.0, "cov_low=6.0 must be below cov_high=5.0.*lower cov_low or raise cov_high"),
        ("cov_high", float("nan"), "GPPOConfig.cov_high must be a number"),
    ],
)
def test_clip_cov_parameters_are_validated(field, value, message):
    with pytest.raises(gppo.GPPOConfigError, match=message):
        gppo.preset("clip-cov", **{field: value})


@pytest.mark.parametrize(
    "preset, field, value, message",
    [
        ("dro", "kl_tau", -0.1, "GPPOConfig.kl_tau must be > 0 and finite, or None"),
        ("vespo", "lambda_neg", 0.0, "GPPOConfig.lambda_neg must be > 0 and finite"),
        ("vespo", "k_pos", -1.0, "GPPOConfig.k_pos must be >= 0"),
        ("kl-cov", "cov_kl_coef", float("inf"), "GPPOConfig.cov_kl_coef must be >= 0 and finite"),
        (
            "ppo",
            "kl_tau",
            0.1,
            "kl_tau=0.1 is not used by the point tv x sample x clip: kl_tau is a parameter of rules mask, pg",
        ),
        ("gpg", "cov_ratio", 0.1, "cov_ratio is a parameter of rules clip-cov, kl-cov"),
    ],
)
def test_new_parameters_are_validated(preset, field, value, message):
    with pytest.raises(gppo.GPPOConfigError, match=message):
        gppo.preset(preset, **{field: value})


def test_advantage_linearity_is_declared_by_the_rules():
    """Scaling every advantage by c > 0 scales the loss by c exactly where the rule declares
    l(w A) = w l(A) (the verl plugin folds rollout weights into A only then)."""
    batch, _ = inputs(0, spread=1.0)
    overrides = {"clip-cov": dict(cov_ratio=0.1)}
    names = ["gpg", "dro", "kl-cov", "clip-cov", "vespo", "prime-dppo-kl", "icepop", "gppo", "ppo", "luspo"]
    for name in names:
        cfg = gppo.preset(name, **overrides.get(name, {}))
        losses = []
        for c in (1.0, 10.0):
            torch.manual_seed(0)  # clip-cov draws the same permutation
            scaled = gppo.TokenBatch(
                logp=batch.logp, logp_behavior=batch.logp_behavior, advantages=c * batch.advantages, mask=batch.mask
            )
            losses.append(gppo.policy_loss(scaled, cfg)[0])
        linear = gppo.RULES[cfg.rule].is_advantage_linear(cfg)
        assert torch.isclose(losses[1], 10.0 * losses[0], rtol=1e-9).item() == linear, name
