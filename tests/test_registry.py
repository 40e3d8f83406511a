"""The registries: a divergence, an estimator and a rule registered from outside the package work
everywhere a built-in does, against independent float64 references; parameters are declared."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import gppo
from gppo import theory
from gppo.core import registry
from tests.test_trainer import micro_config


def triangular(t):
    """Triangular discrimination (Le Cam): f(t) = (t - 1)^2 / (t + 1), D = sum (p - q)^2 / (p + q)."""
    return (t - 1) ** 2 / (t + 1)


@pytest.fixture
def registered():
    """Register entries for one test and remove them afterwards (the registries are global)."""
    added = []

    def add(axis, name):
        added.append((axis, name))

    yield add
    for axis, name in added:
        axis.remove(name)


@pytest.fixture
def tri(registered):
    gppo.register_divergence("triangular", triangular)
    registered(gppo.DIVERGENCES, "triangular")
    return gppo.divergence("triangular")


def random_pairs(seed, vocab):
    gen = np.random.default_rng(seed)
    p, q = gen.dirichlet(np.full(vocab, 0.7)), gen.dirichlet(np.full(vocab, 0.7))
    p[0] = 0.0  # p = 0 < q
    q[1] = 0.0  # q = 0 < p
    p[2] = q[2] = 0.0
    return p / p.sum(), q / q.sum()


# ------------------------------------------------------------------------------ divergences
def test_registered_divergence_matches_the_brute_force_sum(tri):
    assert (tri.f_prime_at_1, tri.curvature, tri.f_tilde_at_0, tri.slope_at_inf) == pytest.approx((0, 1, 1, 1))
    for seed in range(5):
        p, q = random_pairs(seed, 12)
        # D = sum (p - q)^2 / (p + q) over cells with p + q > 0 (its limits: q at p = 0, p at q = 0)
        expected = sum((a - b) ** 2 / (a + b) for a, b in zip(p, q) if a + b > 0)
        assert tri.between(torch.tensor(p), torch.tensor(q)).item() == pytest.approx(expected, rel=1e-12)
    t = torch.tensor([0.0, 1e-3, 0.5, 1.0, 2.0, 1e4], dtype=torch.float64)
    torch.testing.assert_close(tri.f(t), triangular(t))


def test_registered_divergence_in_float32_matches_float64():
    gppo.register_divergence("tri32", triangular)
    try:
        div = gppo.divergence("tri32")
        gen = torch.Generator().manual_seed(0)
        log_p = torch.log_softmax(torch.randn(64, 50, generator=gen, dtype=torch.float64), -1)
        log_q = torch.log_softmax(torch.randn(64, 50, generator=gen, dtype=torch.float64), -1)
        exact = div.between_log(log_p, log_q)
        single = div.between_log(log_p.float(), log_q.float())
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), exact, rtol=1e-5, atol=0)
    finally:
        gppo.DIVERGENCES.remove("tri32")


GENERATORS = {  # the built-ins' generators as plain torch functions (DESIGN of docs/design.md s.2)
    "tv": lambda t: (t - 1).abs() / 2,
    "kl": lambda t: -torch.log(t),
    "rkl": lambda t: t * torch.log(t),
    "chi2": lambda t: (t - 1) ** 2,
    "neyman": lambda t: (t - 1) ** 2 / t,
    "hellinger": lambda t: (t.sqrt() - 1) ** 2,
    "js": lambda t: 0.5 * (t * torch.log(2 * t / (1 + t)) + torch.log(2 / (1 + t))),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generic_numerics_reproduce_the_built_in_closed_forms(name, registered):
    """A built-in's generator registered as a user divergence: same limits and constants, same
    D_f with zero cells, same single-sample ratio interval (bisection vs closed form)."""
    gppo.register_divergence(f"my-{name}", GENERATORS[name])
    registered(gppo.DIVERGENCES, f"my-{name}")
    mine, builtin = gppo.divergence(f"my-{name}"), gppo.divergence(name)
    for attr in ("f_prime_at_1", "f_tilde_at_0", "slope_at_inf"):
        assert getattr(mine, attr) == pytest.approx(getattr(builtin, attr), rel=1e-9), attr
    assert mine.curvature == pytest.approx(builtin.curvature, rel=1e-6) if builtin.curvature else mine.curvature is None
    for seed in range(4):
        p, q = (torch.tensor(x) for x in random_pairs(seed, 9))
        expected = builtin.between(p, q).item()
        got = mine.between(p, q).item()
        assert got == expected if math.isinf(expected) else got == pytest.approx(expected, rel=1e-9, abs=1e-13)
    # ratios that overflow or underflow float64 (t = p/q = e^{+-799}) take the limits
    log_p = torch.tensor([-800.0, -1.0, -50.0, -1e-12, -0.3], dtype=torch.float64)
    log_q = torch.tensor([-1.0, -800.0, -1e-12, -50.0, -0.3], dtype=torch.float64)
    for got, expected in zip(mine.cell_terms(log_p, log_q).tolist(), builtin.cell_terms(log_p, log_q).tolist()):
        assert got == expected if math.isinf(expected) else got == pytest.approx(expected, rel=1e-9, abs=1e-300)
    delta = torch.tensor([0.01, 0.2, 0.9], dtype=torch.float64)
    for a, b in zip(mine.normalized_inverse(delta), builtin.normalized_inverse(delta)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "name,closed_form",
    [
        ("tv", lambda d: min(d, 1.0)),
        ("chi2", lambda d: math.sqrt(d) / 2 if d <= 1 else d / (1 + d)),  # binary min: 4V^2, then V / (1 - V)
        ("hellinger", lambda d: math.sqrt(d * (1 - d / 4)) if d <= 2 else 1.0),  # Le Cam, tight
        ("triangular", lambda d: min(math.sqrt(d / 2), 1.0)),  # binary min at q = (1 - V) / 2: 2 V^2
    ],
)
def test_generic_tv_bound_is_the_tight_closed_form(name, closed_form, registered):
    f = triangular if name == "triangular" else GENERATORS[name]
    gppo.register_divergence(f"bound-{name}", f)
    registered(gppo.DIVERGENCES, f"bound-{name}")
    div = gppo.divergence(f"bound-{name}")
    for delta in (1e-4, 0.01, 0.3, 0.99, 1.5, 2.5):
        assert div.tv_bound(delta) == pytest.approx(closed_form(delta), rel=1e-9, abs=1e-12), delta
    assert theory.tv_radius(div, 0.01) == div.tv_bound(0.01)


@pytest.mark.parametrize("delta", [0.001, 0.05, 0.5])
def test_generic_kl_tv_bound_is_tight_and_below_pinsker(delta, registered):
    """At V = tv_bound(delta) the smallest binary KL(mu || pi) with TV = V is delta (numpy grid over
    q with the closed-form binary KL): no pair with a larger TV fits the radius, and one just fits."""
    gppo.register_divergence("my-kl-bound", GENERATORS["kl"])
    registered(gppo.DIVERGENCES, "my-kl-bound")
    v = gppo.divergence("my-kl-bound").tv_bound(delta)
    assert v <= math.sqrt(delta / 2)  # Pinsker is valid, so the tight bound is at most it
    q = np.linspace(0, 1 - v, 400_001)[1:-1]
    p = q + v
    kl = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))  # KL(mu || pi), mu = q
    assert kl.min() == pytest.approx(delta, rel=1e-6)


def test_registration_refuses_what_is_not_a_divergence(registered):
    with pytest.raises(ValueError, match="f\\(1\\) must be 0"):
        gppo.register_divergence("shifted", lambda t: (t - 1) ** 2 + 1)
    with pytest.raises(ValueError, match="not convex"):
        gppo.register_divergence("concave", lambda t: -((t - 1) ** 2))
    with pytest.raises(ValueError, match="not convex.*subgradient"):
        gppo.register_divergence("bad-slope", lambda t: (t - 1) ** 2, f_prime_at_1=3.0)
    with pytest.raises(TypeError, match="torch function"):
        gppo.register_divergence("number", 3.0)
    with pytest.raises(ValueError, match="'kl' is a built-in divergence"):
        gppo.register_divergence("kl", GENERATORS["kl"])
    with pytest.raises(ValueError, match="non-empty string without surrounding spaces \\(got ' tri'\\)"):
        gppo.register_divergence(" tri", triangular)
    with pytest.raises(ValueError, match="'mask' is a built-in rule"):
        gppo.register_rule("mask")
    gppo.register_divergence("twice", triangular)
    registered(gppo.DIVERGENCES, "twice")
    with pytest.raises(ValueError, match="already registered"):
        gppo.register_divergence("twice", triangular)
    with pytest.raises(ValueError, match="cannot be removed"):
        gppo.DIVERGENCES.remove("tv")
    with pytest.raises(ValueError, match="takes no parameters"):
        gppo.divergence("twice", alpha=0.5)


def test_registered_divergence_in_every_estimator_rule_preset_and_theory(tri):
    gen = torch.Generator().manual_seed(1)
    log_mu = torch.log_softmax(torch.randn(4, 6, 30, generator=gen, dtype=torch.float64), -1)
    log_pi = torch.log_softmax(log_mu + 0.5 * torch.randn(4, 6, 30, generator=gen, dtype=torch.float64), -1)
    ids = torch.multinomial(log_mu.exp().view(-1, 30), 1, generator=gen).view(4, 6)
    top_logq, top_ids = log_mu.topk(5, -1)
    logits = log_pi.clone().requires_grad_(True)
    batch = gppo.TokenBatch(
        logp=torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0],
        logp_behavior=log_mu.gather(-1, ids[..., None])[..., 0],
        advantages=torch.tensor([1.0, -1, 0.5, -2]),
        mask=torch.ones(4, 6),
        token_ids=ids,
        topk_ids=top_ids,
        topk_logp_behavior=top_logq,
        topk_logp=log_pi.gather(-1, top_ids),
        logits=log_pi,
        logp_behavior_full=log_mu,
    )
    q, p = batch.logp_behavior.exp(), batch.logp.detach().exp()
    binary = (p - q) ** 2 / (p + q) + (q - p) ** 2 / (2 - p - q)  # the rest cell: 1 - p vs 1 - q
    torch.testing.assert_close(gppo.estimate(gppo.preset("gppo", divergence="triangular"), batch), binary)
    full = ((log_pi.exp() - log_mu.exp()) ** 2 / (log_pi.exp() + log_mu.exp())).sum(-1)
    torch.testing.assert_close(
        gppo.estimate(gppo.preset("gppo", divergence="triangular", estimator="full"), batch), full
    )
    for name in ("dppo-binary-tv", "dppo-topk-tv", "ppo", "ripo", "gspo", "gmpo", "trm"):
        loss, metrics = gppo.policy_loss(
            batch, gppo.preset(name, divergence="triangular", **({"top_k": 5} if "topk" in name else {}))
        )
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and metrics["divergence/mean"] >= 0, name
    # the binary ratio interval: its boundary is where the binary estimate equals the radius
    lo, hi = theory.ratio_interval("triangular", "binary", [0.01, 0.3, 0.9], 0.02, 0.05)
    qs = np.array([0.01, 0.3, 0.9])
    binary_at = lambda r: (qs * r - qs) ** 2 / (qs * r + qs) + (qs - qs * r) ** 2 / (2 - qs * r - qs)
    inside_hi = hi < 1 / qs  # hi = 1/q when even p = 1 stays inside
    np.testing.assert_allclose(binary_at(hi)[inside_hi], 0.05, rtol=1e-9)
    np.testing.assert_allclose(binary_at(lo)[lo > 0], 0.02, rtol=1e-9)
    assert lo[0] == 0 and binary_at(0.0)[0] <= 0.02  # q = 0.01 may drop to p = 0 inside the radius
    assert theory.improvement_bound("triangular", 0.02, xi=1.0, horizon=10) == pytest.approx(
        -min(2 * 10 * 9 * 0.01, 4 * 10 * 0.1)
    )  # TV <= sqrt(0.02 / 2) = 0.1


def test_two_training_steps_with_a_registered_divergence(tri, micro_model, tmp_path):
    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict

    assert from_dict({"divergence": "triangular"}).gppo_config().divergence == "triangular"
    config = micro_config(
        micro_model,
        tmp_path / "run",
        steps=2,
        eval_every=0,
        save_every=0,
        preset="dppo-binary-tv",
        divergence="triangular",
    )
    Trainer(config).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(r["loss/divergence/mean"]) for r in records[1:])


def test_cli_help_lists_registered_names(tri, capsys):
    from gppo.cli import main

    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "triangular" in help_text
    assert "parameter of rule soft" in help_text  # tau_pos's help says which point reads it


# ------------------------------------------------------------------------------ estimators
def test_registered_per_token_estimator_is_a_ratio_interval_estimator(registered):
    """A hand-written binary estimator, registered per token: clip accepts it, its loss and gradient
    equal the built-in binary's, and theory gives it the same interval (by bisection)."""

    @gppo.register_estimator("my-binary", per_token=True)
    def my_binary(div, logp, logq):
        """D_f on {sampled, rest}, written directly."""
        log_rest = lambda x: torch.log1p(-x.exp().clamp(max=1 - 1e-12))
        return div.cell_terms(logp, logq) + div.cell_terms(log_rest(logp), log_rest(logq))

    registered(gppo.ESTIMATORS, "my-binary")
    entry = gppo.ESTIMATORS["my-binary"]
    assert entry.has_ratio_interval and not entry.needs_rollout_topk and entry.summary.startswith("D_f on")
    gen = torch.Generator().manual_seed(3)
    logp = torch.log(torch.rand(5, 7, generator=gen, dtype=torch.float64) * 0.9 + 0.05).requires_grad_(True)
    batch = gppo.TokenBatch(
        logp=logp,
        logp_behavior=(logp + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)).detach().clamp(max=-1e-3),
        advantages=torch.randn(5, generator=gen, dtype=torch.float64),
        mask=torch.ones(5, 7),
    )
    for rule in ("clip", "mask"):
        mine, _ = gppo.policy_loss(batch, gppo.preset("ripo", rule=rule, estimator="my-binary"))
        ref, _ = gppo.policy_loss(batch, gppo.preset("ripo", rule=rule, estimator="binary"))
        torch.testing.assert_close(mine, ref)
        torch.testing.assert_close(torch.autograd.grad(mine, logp)[0], torch.autograd.grad(ref, logp)[0])
    q = [0.02, 0.4, 0.95]
    for a, b in zip(theory.ratio_interval("kl", "my-binary", q, 0.05), theory.ratio_interval("kl", "binary", q, 0.05)):
        np.testing.assert_allclose(a, b, rtol=1e-9)
    assert "my-binary" in theory.ratio_interval_estimators()


def test_registered_batch_estimator_declares_fields_and_parameters(registered):
    @gppo.register_estimator("sampled-or-zero", needs=("token_ids",), params=("top_k",))
    def sampled_or_zero(div, batch, anchor, config):
        """Cell estimate on tokens with id < top_k, 0 elsewhere."""
        cell = div.cell_terms(batch.logp, anchor.logq)
        return torch.where(batch.token_ids < config.top_k, cell, 0.0)

    registered(gppo.ESTIMATORS, "sampled-or-zero")
    cfg = gppo.preset("gppo", estimator="sampled-or-zero", top_k=2)
    assert cfg.rollout_top_k == 0  # needs no top-K at rollout
    batch = gppo.TokenBatch(
        logp=torch.log(torch.full((1, 3), 0.5)),
        logp_behavior=torch.log(torch.full((1, 3), 0.25)),
        advantages=torch.ones(1),
        mask=torch.ones(1, 3),
        token_ids=torch.tensor([[0, 1, 2]]),
    )
    expected = 0.5 * 0.25 * 1.0  # TV cell q f~(2) = 0.25 * |2 - 1| / 2
    torch.testing.assert_close(gppo.estimate(cfg, batch), torch.tensor([[expected, expected, 0.0]]))
    with pytest.raises(gppo.GPPOInputError, match="TokenBatch.token_ids is missing but estimator 'sampled-or-zero'"):
        gppo.estimate(cfg, dataclasses.replace(batch, token_ids=None))
    with pytest.raises(gppo.GPPOConfigError, match="ratio interval"):
        gppo.preset("ppo", estimator="sampled-or-zero")
    assert gppo.preset("gppo", estimator="sampled-or-zero").top_k == 20  # the field's default
    with pytest.raises(ValueError, match="not GPPOConfig parameter fields"):
        gppo.register_estimator("bad", params=("my_knob",))
    with pytest.raises(ValueError, match="not TokenBatch fields"):
        gppo.register_estimator("bad", needs=("topk_logits",))
    with pytest.raises(ValueError, match="must declare top_k"):
        gppo.register_estimator("bad", needs=("topk_ids", "topk_logp"), anchor=("token", "topk"))


# ------------------------------------------------------------------------------ rules
def test_registered_rule_with_declared_parameters(registered):
    @gppo.register_rule("plain-pg", params=("truncation",), uses_estimate=False)
    def plain_pg(ctx):
        """-A r: the policy gradient without a region."""
        return gppo.RuleOutput(-ctx.adv * ctx.ratio, None)

    registered(gppo.RULES, "plain-pg")
    gen = torch.Generator().manual_seed(4)
    logp = torch.log(torch.rand(3, 5, generator=gen) * 0.9 + 0.05).requires_grad_(True)
    batch = gppo.TokenBatch(
        logp=logp, logp_behavior=logp.detach() + 0.1, advantages=torch.tensor([1.0, -1, 2]), mask=torch.ones(3, 5)
    )
    cfg = gppo.preset("cispo", rule="plain-pg")
    assert cfg.truncation == 5.0  # kept from the preset: the rule declares it
    mine, _ = gppo.policy_loss(batch, dataclasses.replace(cfg, truncation=None))
    ref, _ = gppo.policy_loss(batch, gppo.preset("cispo", truncation=None))  # truncate without a cap: -A r
    torch.testing.assert_close(mine, ref)
    torch.testing.assert_close(torch.autograd.grad(mine, logp)[0], torch.autograd.grad(ref, logp)[0])
    with pytest.raises(gppo.GPPOConfigError, match="tau_pos=2.0 is not used by the point rule 'plain-pg'"):
        gppo.preset("cispo", rule="plain-pg", tau_pos=2.0)
    with pytest.raises(gppo.GPPOConfigError, match="uses no divergence estimate"):
        gppo.preset("ppo", rule="plain-pg")
    with pytest.raises(ValueError, match="unknown estimator 'smaple'"):
        gppo.register_rule("x", estimators=("smaple",))


# ------------------------------------------------------------------------------ config and presets
def test_every_preset_sets_only_parameters_its_point_uses():
    for name, p in gppo.PRESETS.items():
        cfg = gppo.preset(name)
        for key in p.fields:
            assert getattr(cfg, key) == p.fields[key], (name, key)  # nothing dropped
        unused = [
            k
            for k in gppo.core.config.PARAM_FIELDS
            if getattr(cfg, k) is not None
            and k not in gppo.RULES[cfg.rule].params
            and not (
                cfg.uses_estimate
                and k in gppo.ESTIMATORS[cfg.estimator].params + gppo.DIVERGENCES[cfg.divergence].params
            )
        ]
        assert unused == [], name


def test_overrides_drop_preset_parameters_the_new_point_does_not_use():
    assert gppo.preset("dppo-topk-tv").rollout_top_k == 20
    binary = gppo.preset("dppo-topk-tv", estimator="binary")
    assert binary.top_k is None and binary.rollout_top_k == 0
    assert gppo.preset("sapo", rule="truncate").tau_pos is None
    assert gppo.preset("ppo").tau_pos is None and gppo.preset("sapo").tau_pos == 1.0
    assert gppo.preset("ppo", divergence="alpha").alpha == 0.5  # the divergence's own default
    # dataclasses.replace keeps a valid config valid (the trainer sets norm_length this way)
    assert dataclasses.replace(gppo.preset("sapo"), norm_length=8).tau_neg == 1.05
    grid = gppo.core.presets.drop_unused(
        {"divergence": "kl", "estimator": "binary", "rule": "mask", "alpha": 0.3, "top_k": 4, "lr": 1e-3}
    )
    assert grid == {"divergence": "kl", "estimator": "binary", "rule": "mask", "lr": 1e-3}


def test_field_help_comes_from_the_registries(tri):
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(gppo.GPPOConfig)}
    assert "triangular" in helps["divergence"] and "topp" in helps["estimator"] and "seq-mask" in helps["rule"]
    assert "parameter of estimators topk, topp; default 20" in helps["top_k"]
    assert "parameter of divergence alpha" in helps["alpha"]


# ------------------------------------------------------------------------------ plugins
class FakeEntryPoint:
    def __init__(self, name, load):
        self.name, self.value, self.load = name, f"{name}_module", load


def test_plugins_load_once_on_first_read(monkeypatch):
    calls = []

    def load():
        calls.append(1)
        gppo.register_divergence("plugin-tri", triangular)

    monkeypatch.setattr(registry, "_plugins", "unloaded")
    monkeypatch.setattr(
        registry.metadata,
        "entry_points",
        lambda group: [FakeEntryPoint("tri", load)] if group == registry.PLUGIN_GROUP else [],
    )
    try:
        assert "plugin-tri" in gppo.DIVERGENCES and "plugin-tri" in list(gppo.ESTIMATORS) + list(gppo.DIVERGENCES)
        assert calls == [1]
        assert gppo.preset("gppo", divergence="plugin-tri").divergence_fn.name == "plugin-tri"
    finally:
        gppo.DIVERGENCES.remove("plugin-tri")


def test_a_broken_plugin_is_an_error_naming_it(monkeypatch):
    def load():
        raise ModuleNotFoundError("No module named 'missing_dep'")

    monkeypatch.setattr(registry, "_plugins", "unloaded")
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [FakeEntryPoint("broken", load)])
    with pytest.raises(ImportError, match="gppo plugin 'broken' .*failed to import: ModuleNotFoundError"):
        gppo.DIVERGENCES.lookup("tv")
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [])
    assert gppo.DIVERGENCES.lookup("tv") is gppo.DIVERGENCES["tv"]  # retried, then loaded


def test_lookup_names_the_closest_entry():
    with pytest.raises(ValueError, match="unknown rule 'sqe-mask' \\(did you mean 'seq-mask'\\?\\); choose one of"):
        gppo.RULES.lookup("sqe-mask")


def test_gppo_config_has_one_field_per_parameter_in_the_params_table():
    from dataclasses import fields

    from gppo.core.params import PARAMS

    declared = [f.name for f in fields(gppo.GPPOConfig) if f.metadata.get("param")]
    assert declared == list(PARAMS)
    assert gppo.core.PARAM_DEFAULTS["top_k"] == 20 and gppo.core.PARAM_DEFAULTS["truncation"] is None
