"""Estimator axis: data-processing order, equality cases, brute-force partitions, missing inputs."""

import math

import pytest
import torch

import gppo
from gppo.core.estimators import full_estimate
from tests.reference import partition_divergence

DIVERGENCE_POINTS = [
    ("tv", {}),
    ("kl", {}),
    ("rkl", {}),
    ("chi2", {}),
    ("neyman", {}),
    ("hellinger", {}),
    ("js", {}),
    ("alpha", {"alpha": 0.5}),
    ("alpha", {"alpha": -0.5}),
]
DIV_IDS = [n + (f"={p['alpha']}" if p else "") for n, p in DIVERGENCE_POINTS]


def make_batch(log_pi, log_mu, k, seed=0, mask=None):
    """A TokenBatch of N positions (B = N, T = 1) sampling each token from mu."""
    n, vocab = log_pi.shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(log_mu.exp(), 1, generator=gen)  # [N,1]
    top_logq, top_ids = log_mu.topk(k, dim=-1)
    return gppo.TokenBatch(
        logp=log_pi.gather(-1, ids),
        logp_behavior=log_mu.gather(-1, ids),
        advantages=torch.ones(n),
        mask=torch.ones(n, 1) if mask is None else mask,
        token_ids=ids,
        topk_ids=top_ids[:, None],
        topk_logp_behavior=top_logq[:, None],
        topk_logp=log_pi.gather(-1, top_ids)[:, None],
        logits=log_pi[:, None],
        logp_behavior_full=log_mu[:, None],
    )


def estimates(batch, name, params, top_k, top_p=0.9):
    out = {}
    for est in ("sample", "cell", "binary", "topk", "topp", "full"):
        used = {k: v for k, v in dict(top_k=top_k, top_p=top_p).items() if k in gppo.ESTIMATORS[est].params}
        cfg = gppo.preset("dppo-topk-tv", divergence=name, estimator=est, **used, **params)
        out[est] = gppo.estimate(cfg, batch)[:, 0]
    return out


def distributions(kind, n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        log_mu = torch.log_softmax(2 * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    else:  # Zipf-like: power-law over a random permutation of the vocabulary per position
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        base = torch.log(ranks**-1.1 / (ranks**-1.1).sum())
        log_mu = torch.stack([base[torch.randperm(vocab, generator=gen)] for _ in range(n)])
    noise = torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    log_pi = torch.log_softmax(log_mu + 0.5 * noise, -1)
    return log_pi, log_mu


@pytest.mark.parametrize("name,params", DIVERGENCE_POINTS, ids=DIV_IDS)
@pytest.mark.parametrize("kind,vocab,n", [("random", 12, 64), ("random", 1000, 32), ("zipf", 50_000, 6)])
def test_data_processing_order(name, params, kind, vocab, n):
    log_pi, log_mu = distributions(kind, n, vocab, seed=vocab)
    e = estimates(make_batch(log_pi, log_mu, k=min(20, vocab - 1)), name, params, top_k=min(20, vocab - 1))
    tol = 1e-10
    assert (e["cell"] <= e["binary"] + tol).all()
    assert (e["binary"] <= e["topp"] + tol).all()  # topp's partition refines binary's
    assert (e["topp"] <= e["topk"] + tol).all()  # and is coarser than topk's
    assert (e["topk"] <= e["full"] + tol).all()
    # full is the exact divergence
    div = gppo.divergence(name, **params)
    torch.testing.assert_close(e["full"], div.between_log(log_pi, log_mu))


@pytest.mark.parametrize("name,params", DIVERGENCE_POINTS, ids=DIV_IDS)
def test_sample_estimate_is_unbiased(name, params):
    """E_{a ~ mu} f~(pi(a)/mu(a)) = D_f(pi || mu): evaluate the estimate at every token, weight by mu."""
    log_pi, log_mu = distributions("random", 1, 30, seed=7)
    vocab = log_mu.shape[-1]
    ids = torch.arange(vocab)[:, None]
    batch = gppo.TokenBatch(
        logp=log_pi[0][ids], logp_behavior=log_mu[0][ids], advantages=torch.ones(vocab), mask=torch.ones(vocab, 1)
    )
    cfg = gppo.preset("ppo", divergence=name, **params)
    per_token = gppo.estimate(cfg, batch)[:, 0]
    expectation = (log_mu[0].exp() * per_token).sum()
    assert expectation.item() == pytest.approx(
        gppo.divergence(name, **params).between_log(log_pi[0], log_mu[0]).item(), rel=1e-9
    )


@pytest.mark.parametrize("name,params", DIVERGENCE_POINTS, ids=DIV_IDS)
def test_partitions_match_brute_force(name, params):
    """topk / topp / binary / cell cells built by hand in Python, exact D_f of the cell masses."""
    k, top_p = 4, 0.6
    log_pi, log_mu = distributions("random", 40, 9, seed=11)
    batch = make_batch(log_pi, log_mu, k=k, seed=5)
    e = estimates(batch, name, params, top_k=k, top_p=top_p)
    alpha = params.get("alpha", 0.5)
    pi, mu = log_pi.exp(), log_mu.exp()
    for i in range(40):
        a = int(batch.token_ids[i, 0])
        order = sorted(range(9), key=lambda j: -float(mu[i, j]))[:k]
        topk_cells = [{j} for j in order] + ([] if a in order else [{a}])
        nucleus, mass = [], 0.0
        for j in order:
            if mass < top_p:
                nucleus.append(j)
            mass += float(mu[i, j])
        topp_cells = [{j} for j in nucleus] + ([] if a in nucleus else [{a}])
        assert e["topk"][i].item() == pytest.approx(
            partition_divergence(name, pi[i], mu[i], topk_cells, alpha), rel=1e-9, abs=1e-13
        )
        assert e["topp"][i].item() == pytest.approx(
            partition_divergence(name, pi[i], mu[i], topp_cells, alpha), rel=1e-9, abs=1e-13
        )
        assert e["binary"][i].item() == pytest.approx(
            partition_divergence(name, pi[i], mu[i], [{a}], alpha), rel=1e-9, abs=1e-13
        )
        cell_only = float(mu[i, a]) * gppo.divergence(name, **params).f_normalized(pi[i, a] / mu[i, a]).item()
        assert e["cell"][i].item() == pytest.approx(cell_only, rel=1e-9, abs=1e-13)


@pytest.mark.parametrize("name,params", DIVERGENCE_POINTS, ids=DIV_IDS)
def test_equality_cases(name, params):
    """docs/design.md section 3: topk = full when pi/mu is constant outside mu's top-K and the sampled token
    (every divergence) ; binary = full on a two-token vocabulary; topk = full when K = V."""
    gen = torch.Generator().manual_seed(2)
    n, vocab, k = 16, 50, 5
    log_mu = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    mu = log_mu.exp()
    top = mu.topk(k, -1).indices
    batch_ids = torch.multinomial(mu, 1, generator=gen)
    in_cells = torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, top, True).scatter_(1, batch_ids, True)
    factor = torch.where(in_cells, torch.rand(n, vocab, generator=gen, dtype=torch.float64) + 0.5, 1.0)
    pi = mu * factor  # pi / mu is constant (after normalising) on the rest cell
    log_pi = torch.log(pi / pi.sum(-1, keepdim=True))
    gen_batch = make_batch(log_pi, log_mu, k=k)
    gen_batch.token_ids = batch_ids
    gen_batch.logp = log_pi.gather(-1, batch_ids)
    gen_batch.logp_behavior = log_mu.gather(-1, batch_ids)
    e = estimates(gen_batch, name, params, top_k=k)
    torch.testing.assert_close(e["topk"], e["full"], rtol=1e-9, atol=1e-12)

    log_pi2, log_mu2 = distributions("random", 8, 2, seed=3)
    e2 = estimates(make_batch(log_pi2, log_mu2, k=1), name, params, top_k=1)
    torch.testing.assert_close(e2["binary"], e2["full"], rtol=1e-9, atol=1e-12)

    log_pi3, log_mu3 = distributions("random", 8, 6, seed=4)
    e3 = estimates(make_batch(log_pi3, log_mu3, k=6), name, params, top_k=6)
    torch.testing.assert_close(e3["topk"], e3["full"], rtol=1e-9, atol=1e-12)


def test_tv_equality_when_sign_is_constant_inside_cells():
    """TV on a partition is exact when pi - mu keeps one sign inside every cell."""
    mu = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1]], dtype=torch.float64)
    pi = torch.tensor([[0.5, 0.2, 0.12, 0.1, 0.08]], dtype=torch.float64)  # rest {2,3,4} has mixed signs
    pi_same_sign = torch.tensor([[0.5, 0.26, 0.08, 0.08, 0.08]], dtype=torch.float64)  # rest all <= mu
    for p, exact in ((pi, False), (pi_same_sign, True)):
        batch = make_batch(p.log(), mu.log(), k=2)
        batch.token_ids = torch.tensor([[0]])
        batch.logp, batch.logp_behavior = p.log()[:, :1], mu.log()[:, :1]
        e = estimates(batch, "tv", {}, top_k=2)
        assert (e["topk"].item() == pytest.approx(e["full"].item())) == exact


def test_membership_is_decided_by_id_not_by_value():
    """A sampled token outside the top-K whose log-prob equals a top-K entry is its own cell."""
    log_mu = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64))
    log_pi = torch.log(torch.tensor([[0.3, 0.3, 0.1, 0.3]], dtype=torch.float64))
    batch = make_batch(log_pi, log_mu, k=2)
    batch.topk_ids = torch.tensor([[[0, 1]]])
    batch.topk_logp_behavior = log_mu[:, None, :2]
    batch.topk_logp = log_pi[:, None, :2]
    batch.token_ids = torch.tensor([[2]])  # same mu as token 1, different id
    batch.logp, batch.logp_behavior = log_pi[:, 2:3], log_mu[:, 2:3]
    got = gppo.estimate(gppo.preset("dppo-topk-tv", top_k=2), batch).item()
    expected = partition_divergence("tv", log_pi[0].exp(), log_mu[0].exp(), [{0}, {1}, {2}])
    assert got == pytest.approx(expected)
    batch.token_ids = torch.tensor([[1]])  # sampled token inside the top-K: not counted twice
    batch.logp, batch.logp_behavior = log_pi[:, 1:2], log_mu[:, 1:2]
    got = gppo.estimate(gppo.preset("dppo-topk-tv", top_k=2), batch).item()
    assert got == pytest.approx(partition_divergence("tv", log_pi[0].exp(), log_mu[0].exp(), [{0}, {1}]))


def test_full_estimator_is_chunk_independent_and_masked():
    log_pi, log_mu = distributions("random", 12, 40, seed=9)
    mask = torch.ones(12, 1)
    mask[3] = 0
    batch = make_batch(log_pi, log_mu, k=5, mask=mask)
    config = gppo.preset("dppo-topk-kl", estimator="full")
    results = [
        full_estimate(config.divergence_fn, batch.logits, batch.logp_behavior_full, batch.mask, c) for c in (1, 5, 1000)
    ]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0])
    torch.testing.assert_close(gppo.estimate(config, batch), results[0])
    assert results[0][3].item() == 0.0


def test_float32_inputs_match_float64():
    log_pi, log_mu = distributions("random", 32, 200, seed=1)
    b64 = make_batch(log_pi, log_mu, k=20)
    b32 = make_batch(log_pi.float(), log_mu.float(), k=20)
    for est in ("sample", "cell", "binary", "topk", "topp", "full"):
        cfg = gppo.preset("dppo-topk-kl", estimator=est)
        torch.testing.assert_close(
            gppo.estimate(cfg, b32).double(), gppo.estimate(cfg, b64).double(), rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize(
    "estimator,field",
    [
        ("topk", "topk_ids"),
        ("topk", "topk_logp"),
        ("topk", "topk_logp_behavior"),
        ("topk", "token_ids"),
        ("topp", "topk_ids"),
        ("full", "logits"),
        ("full", "logp_behavior_full"),
    ],
)
def test_missing_inputs_name_the_field_and_the_fix(estimator, field):
    log_pi, log_mu = distributions("random", 4, 10, seed=0)
    batch = make_batch(log_pi, log_mu, k=3)
    setattr(batch, field, None)
    cfg = gppo.preset("dppo-topk-tv", estimator=estimator)
    with pytest.raises(gppo.GPPOInputError, match=f"TokenBatch.{field} is missing.*estimator '{estimator}'"):
        gppo.estimate(cfg, batch)
    with pytest.raises(gppo.GPPOInputError, match=field):
        gppo.policy_loss(batch, cfg)


def test_old_anchor_needs_its_own_fields():
    log_pi, log_mu = distributions("random", 4, 10, seed=0)
    batch = make_batch(log_pi, log_mu, k=3)
    with pytest.raises(gppo.GPPOInputError, match="logp_old.*recompute"):
        gppo.estimate(gppo.preset("dppo-binary-tv", anchor="old"), batch)
    batch.logp_old = batch.logp_behavior
    with pytest.raises(gppo.GPPOInputError, match="topk_logp_old"):
        gppo.estimate(gppo.preset("dppo-topk-tv", anchor="old"), batch)
    batch.topk_logp_old = batch.topk_logp_behavior
    same = gppo.estimate(gppo.preset("dppo-topk-tv", anchor="old"), batch)
    torch.testing.assert_close(same, gppo.estimate(gppo.preset("dppo-topk-tv"), batch))


def test_estimators_registry_declares_inputs():
    assert set(gppo.ESTIMATORS) == {"sample", "cell", "binary", "topk", "topp", "full"}
    assert "topk_ids" in gppo.ESTIMATORS["topk"].needs
    assert gppo.ESTIMATORS["binary"].needs == ()
    with pytest.raises(gppo.GPPOConfigError, match="did you mean 'binary'"):
        gppo.preset("dppo-binary-tv", estimator="binry")


def test_gather_logp_equals_separate_gathers_on_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=gen, dtype=torch.float64, requires_grad=True)
    token_ids = torch.randint(0, 50, (2, 5), generator=gen)
    topk_ids = torch.randint(0, 50, (2, 5, 4), generator=gen)
    weights = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64)

    def objective(logp, topk_logp):
        return (logp * weights[..., 0]).sum() + (topk_logp * weights[..., 1:]).sum()

    log_probs = torch.log_softmax(logits, -1)
    logp, topk_logp = gppo.gather_logp(log_probs, token_ids, topk_ids)
    (grad_one,) = torch.autograd.grad(objective(logp, topk_logp), logits, retain_graph=True)
    separate = (log_probs.gather(-1, token_ids[..., None]).squeeze(-1), log_probs.gather(-1, topk_ids))
    (grad_two,) = torch.autograd.grad(objective(*separate), logits)
    assert torch.equal(logp, separate[0]) and torch.equal(topk_logp, separate[1])
    torch.testing.assert_close(grad_one, grad_two)
    only_tokens, none = gppo.gather_logp(log_probs, token_ids)
    assert none is None and torch.equal(only_tokens, separate[0])


@pytest.mark.parametrize("name", sorted(gppo.DIVERGENCES))
def test_binary_estimate_stays_finite_when_a_probability_rounds_to_one(name):
    # mu(a) = 1.0 in float32 (log-prob 0.0, common for confident tokens) leaves the rest cell with
    # mass 0; chi2 / rkl / kl would be infinite there. The rest mass is floored as in top-K.
    logp = torch.tensor([[math.log(0.9), 0.0]])
    logq = torch.tensor([[0.0, math.log(0.9)]])
    batch = gppo.TokenBatch(
        logp=logp.clone().requires_grad_(True),
        logp_behavior=logq,
        advantages=torch.tensor([-1.0]),
        mask=torch.ones(1, 2),
    )
    cfg = gppo.preset("dppo-binary-tv", divergence=name)
    est = gppo.estimate(cfg, batch)
    assert torch.isfinite(est).all() and (est > 0).all()
    loss, metrics = gppo.policy_loss(batch, cfg)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())


def test_precomputed_vocabulary_reductions_equal_the_logits_path():
    """TokenBatch.full_estimate / kl_ref_full / entropy (computed by the caller, e.g. chunk by chunk
    from hidden states) give the loss, gradient and metrics of the [B,T,V] logits path."""
    torch.manual_seed(0)
    B, T, V = 3, 5, 7
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    log_mu = torch.log_softmax(torch.randn(B, T, V, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(torch.randn(B, T, V, dtype=torch.float64), -1)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    config = gppo.preset("dppo-binary-kl", estimator="full", kl_coef=0.3, kl_estimator="full")
    common = dict(
        logp_behavior=log_mu.gather(-1, ids[..., None])[..., 0],
        advantages=torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
        mask=mask,
    )

    log_pi = torch.log_softmax(logits, -1)
    logp = log_pi.gather(-1, ids[..., None])[..., 0]
    via_logits = gppo.TokenBatch(logp=logp, logits=logits, logp_behavior_full=log_mu, logp_ref_full=log_ref, **common)
    loss_a, metrics_a = gppo.policy_loss(via_logits, config)
    (grad_a,) = torch.autograd.grad(loss_a, logits, retain_graph=True)

    pi = log_pi.exp()  # direct sums, written here: KL(pi || mu), KL(pi || ref), entropy
    reduced = gppo.TokenBatch(
        logp=logp,
        full_estimate=(log_mu.exp() * (log_mu - log_pi)).sum(-1).detach(),
        kl_ref_full=(pi * (log_pi - log_ref)).sum(-1),
        entropy=-(pi * log_pi).sum(-1),
        **common,
    )
    loss_b, metrics_b = gppo.policy_loss(reduced, config)
    (grad_b,) = torch.autograd.grad(loss_b, logits)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-10, atol=1e-12)
    assert metrics_b.keys() == metrics_a.keys()
    for name in metrics_a:
        assert metrics_b[name] == pytest.approx(metrics_a[name], rel=1e-6, abs=1e-9), name  # entropy: float32


def test_full_estimator_names_both_ways_to_feed_it():
    batch = gppo.TokenBatch(
        logp=torch.zeros(1, 2) - 1, logp_behavior=torch.zeros(1, 2) - 1, advantages=torch.ones(1), mask=torch.ones(1, 2)
    )
    with pytest.raises(gppo.GPPOInputError, match="TokenBatch.logits is missing.*or TokenBatch.full_estimate"):
        gppo.estimate(gppo.preset("dppo-binary-tv", estimator="full"), batch)
