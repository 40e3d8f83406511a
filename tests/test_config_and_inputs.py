"""Presets as data, config validation and bad TokenBatch inputs: each a clear error."""

import math

import pytest
import torch

import gppo

EXPECTED_PRESETS = {
    "ppo",
    "grpo",
    "dapo",
    "dppo-binary-tv",
    "dppo-binary-kl",
    "dppo-topk-tv",
    "dppo-topk-kl",
    "ripo",
    "gspo",
    "gmpo",
    "cispo",
    "pg-is",
    "minirl",
    "sapo",
    "dcpo",
    "trm",
    "gppo",
    "gpg",
    "clip-cov",
    "kl-cov",
    "dro",
    "dr-grpo",
    "luspo",
    "vespo",
    "prime-dppo-kl",
    "icepop",
    "cppo",
    "drpo",
}


def small_batch(**changes):
    gen = torch.Generator().manual_seed(0)
    logp = torch.log(torch.rand(3, 4, generator=gen) * 0.9 + 0.05)
    fields = dict(
        logp=logp, logp_behavior=logp + 0.05, advantages=torch.tensor([1.0, -1.0, 0.5]), mask=torch.ones(3, 4)
    )
    fields.update(changes)
    return gppo.TokenBatch(**fields)


def test_every_seed_method_is_a_preset_with_its_point():
    assert set(gppo.PRESETS) == EXPECTED_PRESETS
    for name, p in gppo.PRESETS.items():
        cfg = gppo.preset(name)
        assert isinstance(cfg, gppo.GPPOConfig)
        for key, value in p.fields.items():
            assert getattr(cfg, key) == value
        assert p.summary and p.source
    assert gppo.preset("ppo").delta_low == 0.1  # eps = 0.2 as a TV radius
    gmpo = gppo.preset("gmpo")
    assert 1 - 2 * gmpo.delta_low == pytest.approx(math.exp(-0.4))
    assert 1 + 2 * gmpo.delta_high == pytest.approx(math.exp(0.4))
    assert gppo.preset("gppo").__class__ is gppo.GPPOConfig
    assert "why" in gppo.core.presets.__doc__ or gppo.PRESETS["gppo"].summary


def test_preset_overrides_field_by_field():
    cfg = gppo.preset("dppo-binary-tv", divergence="hellinger", delta_high=0.02, anchor="old")
    assert (cfg.divergence, cfg.estimator, cfg.rule, cfg.delta_low, cfg.delta_high, cfg.anchor) == (
        "hellinger",
        "binary",
        "mask",
        0.15,
        0.02,
        "old",
    )
    assert gppo.PRESETS["dppo-binary-tv"].fields["divergence"] == "tv"  # the table is untouched
    with pytest.raises(TypeError):
        gppo.PRESETS["ppo"].fields["rule"] = "mask"


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gppo.preset("dppo-binary-TV"), "unknown preset 'dppo-binary-TV' \\(did you mean 'dppo-binary-tv'"),
        (
            lambda: gppo.preset("ppo", delta_hgih=0.2),
            "unknown GPPOConfig field 'delta_hgih' \\(did you mean 'delta_high'",
        ),
        (lambda: gppo.preset("ppo", divergence="kll"), "did you mean 'kl'"),
        (lambda: gppo.preset("ppo", rule="clipp"), "did you mean 'clip'"),
        (lambda: gppo.preset("ppo", anchor="rollout"), "anchor"),
        (lambda: gppo.preset("ppo", loss_agg_mode="token_mean"), "did you mean 'token-mean'"),
        (lambda: gppo.preset("ppo", estimator="topk"), "rule='mask'"),
        (lambda: gppo.preset("gspo", estimator="binary"), "ratio interval"),
        (lambda: gppo.preset("sapo", divergence="kl"), "set divergence=None"),
        (lambda: gppo.preset("cispo", estimator="topk", divergence="tv"), "uses no divergence"),
        (lambda: gppo.preset("dppo-binary-tv", estimator=None), "needs a divergence and an estimator"),
        (lambda: gppo.preset("ppo", delta_low=0.0), "delta_low must be > 0"),
        (lambda: gppo.preset("ppo", delta_high=float("nan")), "delta_high must be > 0"),
        (lambda: gppo.preset("ppo", dual_clip=0.5), "dual_clip must be > 1"),
        (
            lambda: gppo.preset("sapo", dual_clip=3.0),
            "dual_clip=3.0 is not used by the point rule 'soft'.*rules mask, clip",
        ),
        (
            lambda: gppo.preset("dppo-binary-tv", clip_bounds="dcpo"),
            "clip_bounds='dcpo' is not used by the point tv x binary x mask.*rule clip",
        ),
        (lambda: gppo.preset("ppo", truncation=-1.0), "truncation"),
        (lambda: gppo.preset("ppo", kl_coef=-0.1), "kl_coef"),
        (lambda: gppo.preset("ppo", kl_estimator="k4"), "kl_estimator"),
        (lambda: gppo.preset("ppo", divergence="alpha", alpha=1.0), "alpha"),
        (lambda: gppo.preset("dppo-topk-tv", top_k=0), "top_k"),
        (lambda: gppo.preset("dppo-topk-tv", estimator="topp", top_p=1.5), "top_p must be in \\(0, 1\\]"),
        # a parameter given to a point that does not use it: the field, the point and who uses it
        (
            lambda: gppo.preset("ppo", tau_pos=2.0),
            "tau_pos=2.0 is not used by the point tv x sample x clip: tau_pos is a parameter of rule soft",
        ),
        (lambda: gppo.preset("dppo-binary-tv", seq_reduce="mean"), "seq_reduce='mean' is not used.*rule seq-mask"),
        (
            lambda: gppo.preset("dppo-topk-tv", top_p=0.9),
            "top_p=0.9 is not used by the point tv x topk x mask.*estimator topp",
        ),
        (lambda: gppo.preset("dppo-binary-kl", alpha=0.3), "alpha=0.3 is not used.*divergence alpha"),
        (lambda: gppo.preset("ppo", top_k=5), "top_k=5 is not used.*estimators topk, topp"),
        (lambda: gppo.preset("trm", delta_low=0.1), "delta_low=0.1 is not used by the point kl x sample x seq-mask"),
        (lambda: gppo.preset("cispo", delta_high=0.2), "delta_high=0.2 is not used by the point rule 'truncate'"),
        # wrong types: the field, the value and the fix
        (
            lambda: gppo.preset("ppo", delta_high="0.2"),
            "delta_high must be a number or None, got str '0.2'; pass the number delta_high=0.2",
        ),
        (lambda: gppo.preset("dppo-topk-tv", top_k=2.5), "top_k must be an integer or None, got float 2.5"),
        (lambda: gppo.preset("dppo-topk-tv", top_k=True), "top_k must be an integer or None, got bool"),
        (lambda: gppo.preset("ppo", rule=3), "rule must be a string, got int 3"),
        (lambda: gppo.preset("ppo", kl_coef=None), "kl_coef must be a number, got NoneType"),
        (lambda: gppo.preset("ppo", anchor=["old"]), "anchor must be a string"),
        (lambda: gppo.preset("ppo", kl_coef=float("nan")), "kl_coef must be >= 0 and finite"),
    ],
)
def test_config_errors_name_the_field(call, match):
    with pytest.raises(gppo.GPPOConfigError, match=match):
        call()


def test_valid_batch_passes():
    loss, metrics = gppo.policy_loss(small_batch(), gppo.preset("ppo"))
    assert torch.isfinite(loss) and metrics


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(logp_behavior=torch.zeros(3, 5)), "logp_behavior has shape \\(3, 5\\) but logp has \\(3, 4\\)"),
        (dict(mask=torch.ones(4, 4)), "TokenBatch.mask has shape"),
        (dict(logp=torch.zeros(12)), "logp must be \\[B,T\\]"),
        (dict(advantages=torch.ones(4)), "advantages has shape \\(4,\\): expected \\[B\\]"),
        (dict(advantages=torch.ones(3, 5)), "advantages has shape"),
        (dict(logp=torch.tensor([[float("nan")] * 4] * 3)), "logp is not finite"),
        (dict(logp_behavior=torch.tensor([[-float("inf")] * 4] * 3)), "logp_behavior is not finite"),
        (dict(advantages=torch.tensor([1.0, float("inf"), 0.0])), "advantages is not finite"),
        (dict(mask=torch.zeros(3, 4)), "mask is empty.*zero tokens"),
        (dict(mask=torch.full((3, 4), 0.5)), "values other than 0 and 1"),
        (dict(logp=[[0.0]]), "must be a torch.Tensor"),
        (dict(token_ids=torch.zeros(3, 4)), "integer token ids"),
        (
            dict(topk_ids=torch.zeros(3, 4, 2, dtype=torch.long), topk_logp=torch.zeros(3, 4, 3)),
            "all top-K fields share",
        ),
        (dict(logits=torch.zeros(3, 4, 7), logp_behavior_full=torch.zeros(3, 4, 6)), "same V"),
    ],
)
def test_bad_inputs(changes, match):
    with pytest.raises(gppo.GPPOInputError, match=match):
        gppo.policy_loss(small_batch(**changes), gppo.preset("ppo"))


def test_non_finite_values_outside_the_mask_are_ignored():
    logp = torch.log(torch.full((3, 4), 0.3))
    logp[:, -1] = float("nan")  # padding may hold garbage
    mask = torch.ones(3, 4)
    mask[:, -1] = 0
    loss, _ = gppo.policy_loss(
        small_batch(logp=logp, logp_behavior=logp.nan_to_num(0.0), mask=mask), gppo.preset("dppo-binary-kl")
    )
    assert torch.isfinite(loss)


def test_missing_reference_log_probs_for_the_kl_penalty():
    with pytest.raises(gppo.GPPOInputError, match="logp_ref is missing.*KL penalty"):
        gppo.policy_loss(small_batch(), gppo.preset("grpo", kl_coef=0.04))


def test_estimate_refuses_configs_without_an_estimator():
    with pytest.raises(gppo.GPPOInputError, match="no estimator"):
        gppo.estimate(gppo.preset("sapo"), small_batch())


def test_policy_loss_refuses_a_non_config():
    with pytest.raises(TypeError, match="gppo.preset"):
        gppo.policy_loss(small_batch(), {"rule": "clip"})


def test_garbage_in_padding_never_reaches_the_gradient():
    logp = torch.log(torch.full((3, 4), 0.3)).requires_grad_(True)
    garbage = torch.tensor([0.0, 0.0, 0.0, float("nan")])
    mask = torch.tensor([[1.0, 1, 1, 0]] * 3)
    batch = small_batch(
        logp=logp + garbage,
        logp_behavior=torch.log(torch.full((3, 4), 0.25)) + garbage,
        mask=mask,
        logp_ref=torch.log(torch.full((3, 4), 0.2)) + garbage,
    )
    for name in ("ppo", "gspo", "gmpo", "sapo", "cispo", "trm", "dcpo", "ripo"):
        loss, _ = gppo.policy_loss(batch, gppo.preset(name, kl_coef=0.1))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        assert (grad[:, -1] == 0).all()


def every_field_batch(seed=0, batch=3, length=4, vocab=10, k=3):
    """A TokenBatch with every optional field filled from consistent distributions."""
    gen = torch.Generator().manual_seed(seed)

    def log_dist():
        return torch.log_softmax(torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), -1)

    log_pi, log_mu, log_old, log_ref = log_dist(), log_dist(), log_dist(), log_dist()
    token_ids = torch.randint(vocab, (batch, length), generator=gen)
    topk_ids = log_mu.topk(k, -1).indices

    def at(log_p, ids):
        return log_p.gather(-1, ids[..., None]).squeeze(-1)

    return dict(
        logp=at(log_pi, token_ids), logp_behavior=at(log_mu, token_ids), logp_old=at(log_old, token_ids),
        advantages=torch.randn(batch, generator=gen, dtype=torch.float64), mask=torch.ones(batch, length),
        token_ids=token_ids, topk_ids=topk_ids, topk_logp=log_pi.gather(-1, topk_ids),
        topk_logp_behavior=log_mu.gather(-1, topk_ids), topk_logp_old=log_old.gather(-1, topk_ids),
        logits=log_pi, logp_behavior_full=log_mu, logp_old_full=log_old, logp_ref=at(log_ref, token_ids),
        logp_ref_full=log_ref, entropy=-(log_pi.exp() * log_pi).sum(-1),
        full_estimate=(log_pi.exp() - log_mu.exp()).abs().sum(-1) / 2,
        kl_ref_full=(log_pi.exp() * (log_pi - log_ref)).sum(-1),
    )  # fmt: skip


VARIANTS = {
    "as is": {},
    "anchor old": {"anchor": "old"},
    "full estimator": {"estimator": "full"},
    "full, anchor old": {"estimator": "full", "anchor": "old"},
    "k3 penalty": {"kl_coef": 0.1},
    "exact penalty": {"kl_coef": 0.1, "kl_estimator": "full"},
}


def points():
    """(preset, variant) for every variant that is a point of the preset."""
    for name in gppo.PRESETS:
        for variant, overrides in VARIANTS.items():
            try:
                gppo.preset(name, **overrides)
            except gppo.GPPOConfigError:
                continue
            yield name, variant


@pytest.mark.parametrize("name,variant", list(points()))
def test_missing_fields_is_what_policy_loss_reads(name, variant):
    """GPPOConfig.missing_fields (what the integrations and the trainer consult) against what
    policy_loss does: with every optional field but one, the loss refuses the batch naming that
    field exactly when missing_fields lists it."""
    config = gppo.preset(name, **VARIANTS[variant])
    values = every_field_batch()
    optional = [key for key in values if key not in ("logp", "logp_behavior", "advantages", "mask")]
    assert config.missing_fields(optional) == []
    gppo.policy_loss(gppo.TokenBatch(**values), config)
    for dropped in optional:
        fields = {key: value for key, value in values.items() if key != dropped}
        listed = config.missing_fields(set(fields)) == [dropped]
        try:
            gppo.policy_loss(gppo.TokenBatch(**fields), config)
            refused = False
        except gppo.GPPOInputError as err:
            refused = f"TokenBatch.{dropped} is missing" in str(err)
        assert listed == refused, dropped


def test_anchor_and_reference_distributions_name_the_fields_to_keep():
    assert gppo.preset("gppo").anchor_distribution is None
    assert gppo.preset("dppo-topk-kl", estimator="full").anchor_distribution == "logp_behavior_full"
    assert gppo.preset("dppo-topk-kl", estimator="full", anchor="old").anchor_distribution == "logp_old_full"
    assert gppo.preset("gppo", kl_estimator="full").reference_distribution is None  # no penalty: not read
    assert gppo.preset("gppo", kl_coef=0.1, kl_estimator="full").reference_distribution == "logp_ref_full"
    assert [gppo.preset(p).rollout_top_k for p in ("gppo", "dppo-topk-tv", "cppo")] == [0, 20, 20]
    assert gppo.preset("dppo-topk-tv", estimator="topp", top_p=0.9).rollout_top_k == 20
