"""The verl plugin against verl 0.9 itself: its own policy-loss functions and its own caller.

Config mapping tested here (also in docs/verl.md); float64 inputs, max abs diffs in the docs:

| gppo loss_mode (+ policy_loss fields)       | verl loss_mode | verl actor settings                         |
|---------------------------------------------|----------------|---------------------------------------------|
| gppo_ppo, dual_clip=3                       | vanilla        | clip_ratio=0.2, clip_ratio_c=3              |
| gppo_gspo (seq-mean-token-mean)             | gspo           | clip_ratio_low=3e-4, clip_ratio_high=4e-4   |
| gppo_cispo                                  | cispo          | clip_ratio_low=1.0, clip_ratio_high=4.0     |
| gppo_sapo (seq-mean-token-mean)             | sapo           | tau_pos=1.0, tau_neg=1.05                   |
| gppo_gmpo (seq-mean-token-mean)             | geo_mean       | clip_ratio=0.4                              |
| gppo_dppo_binary_tv, truncation=3           | dppo_tv        | clip_ratio=0.15, clip_ratio_c=3             |
| gppo_dppo_binary_kl, truncation=3           | dppo_kl        | clip_ratio=0.05, clip_ratio_c=3             |
| gppo_gpg                                    | gpg            |                                             |
| gppo_dro                                    | dro            | policy_loss.dro_beta=0.05                   |
| gppo_kl_cov, cov_ratio=0.1                  | kl_cov         | policy_loss.kl_cov_ratio=0.1                |
| gppo_clip_cov, cov_ratio=0.1 (same seed)    | clip_cov       | clip_ratio=0.2, policy_loss.clip_cov_ratio=0.1 |
| gppo_icepop                                 | bypass_mode    | policy_loss.rollout_correction = verl's bypass_pg_token_icepop() |
"""

import sys

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra.errors import InstantiationException  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import gppo  # noqa: E402
from gppo.integrations.verl import MODES, GPPOPolicyLossConfig  # noqa: E402
from tests.conftest import VERL_CONFIG_DIR  # noqa: E402
from tests.conftest import compose_verl_example as compose_example

# The sapo comparison and the caller test run presets with another aggregation on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:gppo preset .* is defined with loss_agg_mode")


# (verl loss_mode, verl actor settings (those of verl's PolicyLossConfig under "policy_loss"),
# gppo loss_mode, gppo fields, loss_agg_mode, noise on log mu, metric whose value must lie
# strictly inside (0, 1) so that both branches are exercised)
CASES = {
    "ppo": (
        "vanilla",
        dict(clip_ratio=0.2, clip_ratio_c=3.0),
        "gppo_ppo",
        dict(dual_clip=3.0),
        "token-mean",
        0.7,
        "gppo/masked_frac",
    ),
    "gspo": (
        "gspo",
        dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
        "gppo_gspo",
        {},
        "seq-mean-token-mean",
        1e-3,
        "gppo/masked_frac",
    ),
    "cispo": (
        "cispo",
        dict(clip_ratio_low=1.0, clip_ratio_high=4.0),
        "gppo_cispo",
        {},
        "token-mean",
        1.5,
        "gppo/truncated_frac",
    ),
    "sapo": ("sapo", dict(tau_pos=1.0, tau_neg=1.05), "gppo_sapo", {}, "seq-mean-token-mean", 0.7, None),
    "gmpo": (
        "geo_mean",
        dict(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4),
        "gppo_gmpo",
        {},
        "seq-mean-token-mean",
        0.7,
        "gppo/masked_frac",
    ),
    "dppo-binary-tv": (
        "dppo_tv",
        dict(clip_ratio=0.15, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=3.0),
        "gppo_dppo_binary_tv",
        dict(truncation=3.0),
        "token-mean",
        0.7,
        "gppo/masked_frac",
    ),
    "dppo-binary-kl": (
        "dppo_kl",
        dict(clip_ratio=0.05, clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=3.0),
        "gppo_dppo_binary_kl",
        dict(truncation=3.0),
        "token-mean",
        0.7,
        "gppo/masked_frac",
    ),
    "gpg": ("gpg", {}, "gppo_gpg", {}, "token-mean", 0.7, None),
    "dro": ("dro", dict(policy_loss=dict(dro_beta=0.05)), "gppo_dro", {}, "seq-mean-token-mean", 0.7, None),
    # 0.1 of the ~60 tokens instead of 2e-4 (one token): several selected, the rest not
    "kl-cov": (
        "kl_cov",
        dict(policy_loss=dict(kl_cov_ratio=0.1)),
        "gppo_kl_cov",
        dict(cov_ratio=0.1),
        "token-mean",
        0.7,
        None,
    ),
    "icepop": (
        "bypass_mode",
        dict(policy_loss=dict(rollout_correction=RolloutCorrectionConfig.bypass_pg_token_icepop())),
        "gppo_icepop",
        {},
        "token-mean",
        1.0,
        "gppo/masked_frac",
    ),
}


def actor_config(policy_loss, loss_agg_mode="token-mean", **settings):
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=loss_agg_mode,
        policy_loss=policy_loss,
        **settings,
    )


def gppo_policy_loss(mode, **fields):
    """A GPPOPolicyLossConfig as verl's bypass mode (old_log_prob = rollout log-probs) builds it."""
    return GPPOPolicyLossConfig(loss_mode=mode, bypass_mode=True, use_v1=True, **fields)


def random_batch(noise, seed=0, batch=8, length=12):
    """Log-probs in (log 0.02, log 0.98), log mu = log pi + noise, sequence advantages of both
    signs broadcast to tokens (as verl passes them), ragged lengths >= 1."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(batch, length, generator=gen, dtype=torch.float64) * 0.96 + 0.02)
    old = (logp + noise * torch.randn(batch, length, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length).clone()
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return old, logp, adv, mask


def loss_and_grad(fn, old, logp, adv, mask, agg, config, weights=None):
    leaf = logp.clone().requires_grad_()
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_gppo_mode_equals_verl_loss_and_gradient(name, seed):
    verl_mode, settings, mode, fields, agg, noise, branch_metric = CASES[name]
    old, logp, adv, mask = random_batch(noise, seed)
    settings = dict(settings)
    verl_cfg = actor_config(PolicyLossConfig(loss_mode=verl_mode, **settings.pop("policy_loss", {})), agg, **settings)
    ours_cfg = actor_config(gppo_policy_loss(mode, **fields), agg)
    verl_loss, verl_grad, _ = loss_and_grad(get_policy_loss_fn(verl_mode), old, logp, adv, mask, agg, verl_cfg)
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn(mode), old, logp, adv, mask, agg, ours_cfg)
    assert verl_grad.abs().max() > 0
    if branch_metric is not None:
        assert 0 < metrics[branch_metric] < 1, metrics
    assert torch.allclose(loss, verl_loss, rtol=0, atol=1e-12), (loss, verl_loss)
    assert torch.allclose(grad, verl_grad, rtol=0, atol=1e-12), (grad - verl_grad).abs().max()


def covariance_candidates(old, logp, adv, mask, eps, low, high):
    """Clip-Cov's candidates, written from the paper: unclipped tokens whose (A - mean A)(log p -
    mean log p) over the batch lies in (low, high)."""
    m = mask.bool()
    cov = (adv - adv[m].mean()) * (logp - logp[m].mean())
    r = torch.exp(logp - old)
    clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
    return m & ~clipped & (cov > low) & (cov < high)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_draws_the_tokens_verl_draws(seed):
    """Under the same torch seed gppo_clip_cov detaches the tokens verl's clip_cov detaches: same
    loss and gradient, with fewer tokens drawn than there are candidates, so that the draw matters."""
    old, logp, adv, mask = random_batch(0.7, seed)
    # covariance band (0.1, 5) instead of (1, 5): on these ~50 tokens (1, 5) holds 2 or 3
    candidates = covariance_candidates(old, logp, adv, mask, 0.2, 0.1, 5.0)
    drawn = max(int(0.1 * int(mask.sum())), 1)
    assert 0 < drawn < int(candidates.sum())
    verl_cfg = actor_config(PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=0.1), clip_ratio=0.2)
    ours_cfg = actor_config(gppo_policy_loss("gppo_clip_cov", cov_ratio=0.1, cov_low=0.1))
    torch.manual_seed(100 + seed)
    verl_loss, verl_grad, _ = loss_and_grad(
        get_policy_loss_fn("clip_cov"), old, logp, adv, mask, "token-mean", verl_cfg
    )
    torch.manual_seed(100 + seed)
    loss, grad, metrics = loss_and_grad(
        get_policy_loss_fn("gppo_clip_cov"), old, logp, adv, mask, "token-mean", ours_cfg
    )
    assert torch.allclose(loss, verl_loss, rtol=0, atol=1e-12), (loss, verl_loss)
    assert torch.allclose(grad, verl_grad, rtol=0, atol=1e-12), (grad - verl_grad).abs().max()
    # the drawn tokens are candidates with zero gradient; the other candidates keep theirs
    detached = candidates & (grad == 0)
    assert int(detached.sum()) == drawn and (grad[candidates & ~detached] != 0).all()
    assert 0 < metrics["gppo/masked_frac"] < 1
    # another seed draws other tokens
    torch.manual_seed(200 + seed)
    _, other, _ = loss_and_grad(get_policy_loss_fn("gppo_clip_cov"), old, logp, adv, mask, "token-mean", ours_cfg)
    assert not torch.equal(other == 0, grad == 0)


@pytest.mark.parametrize(
    "mode,fields,agg",
    [
        ("gppo_drpo", {}, "seq-mean-token-sum-norm"),
        ("gppo_drpo", {"quadratic_delta": 0.15}, "seq-mean-token-sum-norm"),
        ("gppo_cppo", {"estimator": "binary"}, "token-mean"),
    ],
)
def test_paper_only_presets_run_through_verl_unchanged(mode, fields, agg):
    """cppo and drpo, which verl does not ship, reach verl as gppo.policy_loss on verl's tensors
    (their references are the papers' equations, tests/test_cppo_drpo.py)."""
    old, logp, adv, mask = random_batch(0.7, seed=5)
    policy_loss = gppo_policy_loss(mode, **fields)
    loss, grad, _ = loss_and_grad(get_policy_loss_fn(mode), old, logp, adv, mask, agg, actor_config(policy_loss, agg))
    leaf = logp.clone().requires_grad_()
    batch = gppo.TokenBatch(logp=leaf, logp_behavior=old, advantages=adv, mask=mask.double())
    expected, _ = gppo.policy_loss(batch, policy_loss.gppo_config(agg))
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert grad.abs().max() > 0
    assert torch.allclose(loss, expected.detach(), rtol=0, atol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)


def test_verl_loss_fields_under_a_gppo_mode_are_refused():
    with pytest.raises(gppo.GPPOConfigError, match=r"clip_cov_ratio -> cov_ratio"):
        gppo_policy_loss("gppo_clip_cov", clip_cov_ratio=0.1)
    with pytest.raises(gppo.GPPOConfigError, match=r"dro_beta -> kl_tau \(= beta / 2\)"):
        gppo_policy_loss("gppo_dro", dro_beta=0.1)
    assert gppo_policy_loss("gppo_dro", kl_tau=0.05).gppo_config().kl_tau == 0.05


@pytest.mark.parametrize("mode", ["gppo_clip_cov", "gppo_kl_cov", "gppo_dro", "gppo_prime_dppo_kl"])
def test_rollout_weights_are_refused_where_the_loss_is_not_proportional_to_the_advantage(mode):
    """verl's rollout_is_weights multiply the per-token loss; the plugin folds them into A, which
    a penalty term or a selection by A does not allow."""
    old, logp, adv, mask = random_batch(0.7)
    weights = torch.full_like(logp, 0.5)
    config = actor_config(gppo_policy_loss(mode))
    with pytest.raises(gppo.GPPOConfigError, match="not proportional to A"):
        get_policy_loss_fn(mode)(old, logp, adv, mask, "token-mean", config, rollout_is_weights=weights)
    get_policy_loss_fn("gppo_gpg")(
        old, logp, adv, mask, "token-mean", actor_config(gppo_policy_loss("gppo_gpg")), rollout_is_weights=weights
    )


def verl_micro_batch(old, logp, adv, mask, weights, dp_size, extra_tokens, extra_sequences):
    """The TensorDict and flat (no-padding) log-probs that verl's ppo_loss receives for one
    micro-batch, with global counts as a data-parallel run of `dp_size` ranks sets them."""
    batch, length = logp.shape
    lengths = mask.sum(-1)
    prompt_len = 3
    attention = torch.cat([torch.ones(batch, prompt_len, dtype=torch.long), mask.long()], dim=1)
    data = TensorDict(
        {
            "prompts": torch.ones(batch, prompt_len, dtype=torch.long),
            "responses": torch.ones(batch, length, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": mask.long(),
            "old_log_probs": old,
            "advantages": adv,
            "rollout_is_weights": weights,
        },
        batch_size=[batch],
    )
    tu.assign_non_tensor(
        data,
        dp_size=dp_size,
        batch_num_tokens=int(mask.sum()) * dp_size + extra_tokens,
        global_batch_size=batch * dp_size + extra_sequences,
    )
    leaf = logp.clone().requires_grad_()
    # verl's model output: one log-prob per non-pad token; response token j is scored at
    # position prompt_len + j - 1 of its sequence.
    pieces = []
    for i in range(batch):
        n = int(lengths[i])
        zeros = torch.zeros(prompt_len + n, dtype=logp.dtype)
        pieces.append(torch.cat([zeros[: prompt_len - 1], leaf[i, :n], zeros[prompt_len - 1 + n :]]))
    return data, leaf, torch.cat(pieces)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verl_caller_with_global_batch_and_rollout_weights(agg):
    """verl's own ppo_loss (field selection, global token / sequence counts of 2 data-parallel
    ranks, rollout_is_weights) gives the same loss and gradient for vanilla and gppo_ppo."""
    old, logp, adv, mask = random_batch(0.7, seed=3)
    weights = torch.rand(logp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2
    results = []
    for policy_loss, settings in [
        (PolicyLossConfig(loss_mode="vanilla"), dict(clip_ratio_c=3.0)),
        (gppo_policy_loss("gppo_ppo", dual_clip=3.0), {}),
    ]:
        data, leaf, flat = verl_micro_batch(old, logp, adv, mask, weights, dp_size=2, extra_tokens=7, extra_sequences=3)
        loss, metrics = ppo_loss(actor_config(policy_loss, agg, **settings), {"log_probs": flat}, data)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.detach(), grad))
    (verl_loss, verl_grad), (loss, grad) = results
    assert verl_grad.abs().max() > 0
    assert torch.allclose(loss, verl_loss, rtol=0, atol=1e-12)
    assert torch.allclose(grad, verl_grad, rtol=0, atol=1e-12)
    assert "gppo/masked_frac" in metrics


def test_policy_loss_config_restates_gppo_config_fields_with_their_types():
    """GPPOPolicyLossConfig declares every GPPOConfig field by hand (Hydra needs them declared):
    all but those verl owns (aggregation, the KL penalty) or cannot feed (the weight pi_old / mu),
    each as Optional of GPPOConfig's own type."""
    import typing
    from dataclasses import fields

    from gppo.integrations.verl import OVERRIDABLE

    ours = typing.get_type_hints(gppo.GPPOConfig)
    theirs = typing.get_type_hints(GPPOPolicyLossConfig)
    owned_by_verl = {"loss_agg_mode", "norm_length", "kl_coef", "kl_estimator"}
    two_anchors = {"behavior_weight_cap", "behavior_weight_floor", "behavior_weight_mode"}
    assert set(OVERRIDABLE) == set(gppo.GPPOConfig.field_names()) - owned_by_verl - two_anchors
    assert set(OVERRIDABLE) <= {f.name for f in fields(GPPOPolicyLossConfig)}
    for name in OVERRIDABLE:
        base = {t for t in typing.get_args(ours[name]) or (ours[name],) if t is not type(None)}
        assert theirs[name] == typing.Optional[base.pop()], name  # noqa: UP045 (verl's Optional)


def test_entry_point_registers_every_mode():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "gppo"]
    assert ep.value == "gppo.integrations.verl"
    assert ep.load().MODES == MODES
    assert set(MODES) == {"gppo"} | {"gppo_" + n.replace("-", "_") for n in gppo.PRESETS if n != "gppo"}
    for mode in MODES:
        assert mode in POLICY_LOSS_REGISTRY


@pytest.mark.parametrize("version", ["0.9.0", "0.10.0", "0.10.0rc1", "1.0.0", "unknown"])
def test_other_verl_versions_are_refused(version):
    from gppo.integrations.verl import check_verl_version

    with pytest.raises(ImportError, match=rf"verl >=0\.9\.1,<0\.10 .*found verl {version}.*pip install"):
        check_verl_version(version)


@pytest.mark.parametrize("version", ["0.9.1", "0.9.4", "0.9.2.post1"])
def test_verl_0_9_is_accepted(version):
    from gppo.integrations.verl import check_verl_version

    check_verl_version(version)


def test_startup_refuses_topk_estimators():
    for mode in ("gppo_dppo_topk_tv", "gppo_dppo_topk_kl", "gppo_cppo"):
        with pytest.raises(gppo.GPPOConfigError, match="top-K token ids.*python -m gppo.integrations.verl_topk"):
            gppo_policy_loss(mode)
    with pytest.raises(gppo.GPPOConfigError, match="estimator 'full'"):
        gppo_policy_loss("gppo", estimator="full")
    with pytest.raises(gppo.GPPOConfigError, match="estimator 'full'"):
        gppo_policy_loss("gppo", estimator="full", topk_source="batch")


def test_topk_from_the_batch_is_accepted_where_the_loss_function_can_feed_it():
    """topk_source=batch (tests/test_verl_engine.py trains with it): accepted with the rollout
    anchor; pi_old's top-K (anchor old) is fed by nothing; other values and non-gppo modes refused."""
    assert gppo_policy_loss("gppo_dppo_topk_kl", topk_source="batch").gppo_config().estimator == "topk"
    gppo_policy_loss("gppo", estimator="topp", top_p=0.9, topk_source="batch")
    with pytest.raises(gppo.GPPOConfigError, match="topk_logp_old"):
        GPPOPolicyLossConfig(
            loss_mode="gppo_dppo_topk_kl", anchor="old", bypass_mode=False, use_v1=True, topk_source="batch"
        )
    with pytest.raises(gppo.GPPOConfigError, match="topk_source='vllm'.*'batch'"):
        gppo_policy_loss("gppo_dppo_topk_kl", topk_source="vllm")
    with pytest.raises(gppo.GPPOConfigError, match=r"\['topk_source'\].*not a gppo mode"):
        GPPOPolicyLossConfig(loss_mode="vanilla", topk_source="batch")


def test_topk_logits_processor_is_log_softmax_at_mu_ids(monkeypatch):
    """topk_ppo_loss as verl's logits processor: per recorded entry k, a [1, N] tensor equal to
    log_softmax(logits)[id_k], computed over chunks of tokens (7 here, so that chunks have a ragged
    end) with gradients into the logits."""
    import gppo.integrations.verl as plugin

    gen = torch.Generator().manual_seed(0)
    lengths, vocab, k = torch.tensor([5, 9, 3]), 11, 4
    monkeypatch.setattr(sys.modules["gppo.core.token_stats"], "CHUNK_ELEMENTS", 7 * vocab)
    logits = torch.randn(1, int(lengths.sum()), vocab, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(int(lengths.sum()))])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    data = {plugin.TOPK_IDS_KEY: torch.nested.nested_tensor_from_jagged(ids, offsets)}
    out = plugin.topk_ppo_loss(config=None, data=data, student_logits=logits)
    got = torch.stack([out[f"gppo/topk_logp_{j}"] for j in range(k)], -1)
    expected = torch.log_softmax(logits, -1).gather(-1, ids[None])
    assert sorted(out) == [f"gppo/topk_logp_{j}" for j in range(k)] and got.shape == (1, int(lengths.sum()), k)
    assert torch.allclose(got, expected, atol=1e-6)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    with pytest.raises(gppo.GPPOInputError, match="distillation_use_topk=True"):
        plugin.topk_ppo_loss(config=None, model_output={"log_probs": None}, data=data)


def test_topk_policy_loss_outside_topk_ppo_loss_says_how_to_feed_it():
    old, logp, adv, mask = random_batch(0.1)
    config = actor_config(gppo_policy_loss("gppo_dppo_topk_kl", topk_source="batch"))
    with pytest.raises(gppo.GPPOInputError, match="topk_ppo_loss"):
        get_policy_loss_fn("gppo_dppo_topk_kl")(old, logp, adv, mask, "token-mean", config)


def test_metric_keys_do_not_depend_on_the_micro_batch():
    """verl aggregates a metric over micro-batches and ranks only if every one reports it: a
    micro-batch whose advantages are all negative reports the keys of a mixed one."""
    old, logp, adv, mask = random_batch(0.7)
    config = actor_config(gppo_policy_loss("gppo_dppo_binary_tv", delta_low=0.01, delta_high=0.01))
    fn = get_policy_loss_fn("gppo_dppo_binary_tv")
    _, mixed = fn(old, logp, adv, mask, "token-mean", config)
    _, negative = fn(old, logp, -adv.abs(), mask, "token-mean", config)
    assert 0 < mixed["gppo/masked_frac"] < 1
    assert sorted(mixed) == sorted(negative)


def test_startup_refuses_a_weight_between_two_anchors():
    with pytest.raises(gppo.GPPOConfigError, match="rollout_is=token and rollout_is_threshold=10"):
        GPPOPolicyLossConfig(loss_mode="gppo_minirl", bypass_mode=False)
    equivalent = GPPOPolicyLossConfig(loss_mode="gppo_ppo", anchor="old", bypass_mode=False).gppo_config()
    minirl = gppo.preset("minirl")
    assert (equivalent.rule, equivalent.anchor, equivalent.delta_low, equivalent.delta_high) == (
        minirl.rule,
        minirl.anchor,
        minirl.delta_low,
        minirl.delta_high,
    )


def test_startup_checks_the_anchor_against_bypass_mode():
    with pytest.raises(gppo.GPPOConfigError, match="bypass_mode is unset"):
        GPPOPolicyLossConfig(loss_mode="gppo")
    with pytest.raises(gppo.GPPOConfigError, match="anchor=old"):
        GPPOPolicyLossConfig(loss_mode="gppo", bypass_mode=False)
    with pytest.raises(gppo.GPPOConfigError, match="set bypass_mode=false or anchor=behavior"):
        GPPOPolicyLossConfig(loss_mode="gppo", anchor="old", bypass_mode=True, use_v1=True)
    with pytest.raises(gppo.GPPOConfigError, match="trainer.use_v1=true"):
        GPPOPolicyLossConfig(loss_mode="gppo", bypass_mode=True, use_v1=False)
    anchored_old = GPPOPolicyLossConfig(loss_mode="gppo", anchor="old", bypass_mode=False)
    assert anchored_old.gppo_config().anchor == "old"


def test_misconfigurations_fail_loudly():
    with pytest.raises(gppo.GPPOConfigError, match="not a gppo mode"):
        GPPOPolicyLossConfig(loss_mode="vanilla", divergence="kl")
    with pytest.raises(gppo.GPPOConfigError, match="fixes the preset 'cispo'"):
        gppo_policy_loss("gppo_cispo", preset="ppo")
    with pytest.raises(gppo.GPPOConfigError, match="hellinger"):
        gppo_policy_loss("gppo", divergence="helinger")
    old, logp, adv, mask = random_batch(0.1)
    plain = actor_config(PolicyLossConfig(loss_mode="gppo_ppo"))
    with pytest.raises(gppo.GPPOConfigError, match="_target_=gppo.integrations.verl.GPPOPolicyLossConfig"):
        get_policy_loss_fn("gppo_ppo")(old, logp, adv, mask, "token-mean", plain)
    with pytest.raises(gppo.GPPOConfigError, match="token-sum"):
        get_policy_loss_fn("gppo")(old, logp, adv, mask, "token-sum", actor_config(gppo_policy_loss("gppo")))


@pytest.mark.filterwarnings("default")
def test_aggregation_differing_from_the_preset_is_announced():
    old, logp, adv, mask = random_batch(0.1)
    config = actor_config(gppo_policy_loss("gppo_gspo"))
    with pytest.warns(UserWarning, match="'seq-mean-token-mean'; verl's actor.loss_agg_mode='token-mean'"):
        get_policy_loss_fn("gppo_gspo")(old, logp, adv, mask, "token-mean", config)


def test_example_config_takes_plain_hydra_overrides():
    cfg = compose_example(
        "actor_rollout_ref.actor.policy_loss.divergence=hellinger", "actor_rollout_ref.actor.policy_loss.delta_high=0.2"
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, GPPOPolicyLossConfig)
    point = actor.policy_loss.gppo_config(actor.loss_agg_mode)
    assert (point.divergence, point.estimator, point.delta_high, point.anchor) == (
        "hellinger",
        "binary",
        0.2,
        "behavior",
    )
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.actor_rollout_ref.rollout.calculate_log_probs

    cfg = compose_example("actor_rollout_ref.actor.policy_loss.loss_mode=gppo_dppo_topk_tv")
    with pytest.raises(InstantiationException, match="top-K"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    cfg = compose_example("algorithm.rollout_correction.bypass_mode=false")
    with pytest.raises(InstantiationException, match="anchor=old"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    cfg = compose_example(
        "algorithm.rollout_correction.bypass_mode=false", "actor_rollout_ref.actor.policy_loss.anchor=old"
    )
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss.gppo_config().anchor == "old"


def test_verl_own_config_with_command_line_overrides():
    """Without the example config: verl's ppo_trainer plus the overrides docs/verl.md lists."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.actor.policy_loss._target_=gppo.integrations.verl.GPPOPolicyLossConfig",
                "actor_rollout_ref.actor.policy_loss.loss_mode=gppo_dppo_binary_kl",
                "algorithm.rollout_correction.bypass_mode=true",
                "+actor_rollout_ref.actor.policy_loss.bypass_mode=${algorithm.rollout_correction.bypass_mode}",
                "+actor_rollout_ref.actor.policy_loss.use_v1=${trainer.use_v1}",
                "+actor_rollout_ref.actor.policy_loss.delta_high=0.1",
            ],
        )
    point = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss.gppo_config()
    assert (point.divergence, point.estimator, point.delta_low, point.delta_high) == ("kl", "binary", 0.05, 0.1)


def test_verl_legacy_bypass_rewrites_loss_mode():
    """The fact behind the use_v1 guard: verl 0.9.1's legacy trainer calls apply_bypass_mode, which
    overwrites policy_loss.loss_mode (the v1 trainer only swaps old_log_probs)."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    policy_loss = OmegaConf.create({"loss_mode": "gppo"})
    batch = DataProto.from_dict(tensors={"rollout_log_probs": torch.zeros(2, 3)})
    apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), policy_loss)
    assert policy_loss.loss_mode == "bypass_mode"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])


def test_real_model_example_passes_verl_validation():
    """The launch script's config composes and passes verl's own start-up validation, which also
    instantiates GPPOPolicyLossConfig and so runs the plugin's start-up checks."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    script = (VERL_CONFIG_DIR.parent / "run_qwen3_1.7b_dapo_math.sh").read_text()
    assert '--config-dir="$HERE/config" --config-name=qwen3_1.7b_dapo_math' in script
    cfg = compose_example(name="qwen3_1.7b_dapo_math")
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B-Base"
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gppo"
