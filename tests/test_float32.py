"""Float32 (and bfloat16) numerics of the core against float64 references: the data-processing
order of the rest-cell estimators at confident positions, duplicate and surplus top-K entries,
-inf logit columns, NaN inputs, the log-ratio clamp, and the closed forms of the `full` estimator."""

import math

import pytest
import torch

import gppo
from gppo.core.estimators import full_estimate
from tests.reference import brute_force_divergence, partition_divergence

NAMES = sorted(gppo.DIVERGENCES)
POINTS = [(n, {}) for n in NAMES if n != "alpha"] + [("alpha", {"alpha": a}) for a in (-0.5, 0.3, 0.5, 1.5, 2.0)]
POINT_IDS = [n + (f"={p['alpha']}" if p else "") for n, p in POINTS]


def peaked(vocab, n=48, seed=0, spread=0.3):
    """float64 log mu, log pi [n, V] from LLM-like logits: 3 * N(0, 1) plus, at most positions,
    a spike of +4 ... +44 shared by three candidate tokens, so that the rest outside the top-K
    ranges from 1e-1 to 1e-17 while the top-K entries carry log-probs of order -1 (whose
    rounding, 1e-7 in float32 and 4e-3 in bfloat16, exceeds the rest)."""
    gen = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    spike = torch.arange(0.0, 48.0, 4.0, dtype=torch.float64).repeat(n // 12 + 1)[:n]
    for token, offset in ((0, 0.0), (1, 0.5), (2, 1.5)):
        z[:, token] += spike - offset
    z = z[:, torch.randperm(vocab, generator=gen)]
    log_mu = torch.log_softmax(z, -1)
    log_pi = torch.log_softmax(z + spread * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    return log_pi, log_mu, torch.multinomial(log_mu.exp(), 1, generator=gen)


def token_batch(log_pi, log_mu, ids, top_ids, dtype):
    """Every field rounded to `dtype` from the float64 distributions; the logits are pi's log-probs."""
    r = lambda x: x.to(dtype)  # noqa: E731
    n = len(ids)
    return gppo.TokenBatch(
        logp=r(log_pi.gather(-1, ids)),
        logp_behavior=r(log_mu.gather(-1, ids)),
        advantages=torch.ones(n),
        mask=torch.ones(n, 1),
        token_ids=ids,
        topk_ids=top_ids[:, None],
        topk_logp_behavior=r(log_mu.gather(-1, top_ids))[:, None],
        topk_logp=r(log_pi.gather(-1, top_ids))[:, None],
        logits=r(log_pi)[:, None],
        logp_behavior_full=r(log_mu)[:, None],
    )


def estimate(batch, name, params, estimator, **kw):
    cfg = gppo.preset("dppo-topk-tv", divergence=name, estimator=estimator, **params, **kw)
    return gppo.estimate(cfg, batch)[:, 0].double()


@pytest.mark.parametrize("name,params", POINTS, ids=POINT_IDS)
@pytest.mark.parametrize("vocab", [1000, 50_000])
def test_topk_below_full_at_confident_positions(name, params, vocab):
    """top-K <= full (the data-processing inequality) in float32 and bfloat16 at positions whose
    rest mass is below float32 resolution, and float32 top-K equal to float64 top-K."""
    log_pi, log_mu, ids = peaked(vocab, n=48 if vocab < 10_000 else 24)
    top_ids = log_mu.topk(20, -1).indices
    exact = gppo.divergence(name, **params).between_log(log_pi, log_mu)
    topk64 = estimate(token_batch(log_pi, log_mu, ids, top_ids, torch.float64), name, params, "topk")
    # tolerances: float32 a few eps; bfloat16 (eps 7.8e-3, which the rounded cells carry) 1e-3
    for dtype, slack, close in ((torch.float32, 2e-6, 1e-6), (torch.bfloat16, 1e-3, 3e-3)):
        batch = token_batch(log_pi, log_mu, ids, top_ids, dtype)
        topk = estimate(batch, name, params, "topk")
        full = estimate(batch, name, params, "full")
        assert (topk <= full + slack * (1 + full)).all(), dtype
        assert ((topk - topk64).abs() <= close * (1 + topk64)).all(), dtype
        if dtype == torch.float32:
            assert (topk <= exact + 1e-7).all()
    torch.testing.assert_close(
        estimate(token_batch(log_pi, log_mu, ids, top_ids, torch.float32), name, params, "full"),
        exact,
        rtol=1e-5,
        atol=2e-6,
    )


@pytest.mark.parametrize("name", NAMES)
def test_two_rests_below_resolution_contribute_nothing(name):
    """Three cells hold all but 1e-8 of mu's mass and all but 4e-8 of pi's, the same way: in
    float32 the rest cell contributes ~0 (both rests are known to be tiny, not how tiny), not
    rounding noise (6e-8) against a floor; the binary estimate likewise."""
    log_mu = torch.log(torch.tensor([[0.7, 0.25, 0.05 - 1e-8, 1e-8]], dtype=torch.float64))
    log_pi = torch.log(torch.tensor([[0.7, 0.25, 0.05 - 4e-8, 4e-8]], dtype=torch.float64))
    params = {"alpha": 0.5} if name == "alpha" else {}
    for sampled in range(3):
        ids = torch.tensor([[sampled]])
        batch = token_batch(log_pi, log_mu, ids, torch.tensor([[0, 1, 2]]), torch.float32)
        assert estimate(batch, name, params, "topk", top_k=3).item() == pytest.approx(0.0, abs=1e-7)
    log_mu = torch.log(torch.tensor([[1 - 1e-8, 1e-8]], dtype=torch.float64))
    log_pi = torch.log(torch.tensor([[1 - 4e-8, 4e-8]], dtype=torch.float64))
    batch = token_batch(log_pi, log_mu, torch.tensor([[0]]), torch.tensor([[0]]), torch.float32)
    assert estimate(batch, name, params, "binary").item() == pytest.approx(0.0, abs=1e-7)


def test_duplicate_topk_ids_are_merged():
    """vLLM returns the top-K plus the sampled token, which may repeat one of them: one cell."""
    log_pi, log_mu, _ = peaked(40, n=6, spread=1.0)
    top_ids = log_mu.topk(4, -1).indices
    ids = top_ids[:, 1:2]  # the sampled token is mu's second most likely
    with_sampled = torch.cat([ids, top_ids], -1)  # [sampled, top-4]: one id twice
    plain = token_batch(log_pi, log_mu, ids, top_ids, torch.float64)
    doubled = token_batch(log_pi, log_mu, ids, with_sampled, torch.float64)
    for name in ("tv", "kl", "chi2"):
        got = estimate(doubled, name, {}, "topk", top_k=5)
        torch.testing.assert_close(got, estimate(plain, name, {}, "topk", top_k=4))
        for i in range(6):
            cells = [{int(j)} for j in top_ids[i]]
            assert got[i].item() == pytest.approx(
                partition_divergence(name, log_pi[i].exp(), log_mu[i].exp(), cells), rel=1e-9
            )


def test_top_k_bounds_the_entries_used():
    """30 entries provided, top_k = 20: the 20 of largest mu mass are the cells, in any order."""
    log_pi, log_mu, ids = peaked(200, n=6, spread=1.0)
    order = log_mu.argsort(-1, descending=True)
    shuffled = order[:, :30][:, torch.randperm(30, generator=torch.Generator().manual_seed(1))]
    wide = token_batch(log_pi, log_mu, ids, shuffled, torch.float64)
    narrow = token_batch(log_pi, log_mu, ids, order[:, :20], torch.float64)
    for name in ("tv", "kl"):
        torch.testing.assert_close(
            estimate(wide, name, {}, "topk", top_k=20), estimate(narrow, name, {}, "topk", top_k=20)
        )
        torch.testing.assert_close(
            estimate(wide, name, {}, "topp", top_k=20, top_p=0.9),
            estimate(narrow, name, {}, "topp", top_k=20, top_p=0.9),
        )
        assert not torch.allclose(
            estimate(wide, name, {}, "topk", top_k=30), estimate(narrow, name, {}, "topk", top_k=20)
        )


def masked_column_batch(dtype=torch.float32):
    """Logits whose last 5 columns are -inf (a masked vocabulary), mu and ref zero there too."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 30, generator=gen, dtype=torch.float64)
    z[..., 25:] = -math.inf
    log_ref = torch.log_softmax(z + torch.randn(2, 3, 30, generator=gen, dtype=torch.float64), -1)
    logits = z.to(dtype).requires_grad_(True)
    log_probs = torch.log_softmax(logits, -1)
    ids = torch.randint(0, 25, (2, 3), generator=gen)
    batch = gppo.TokenBatch(
        logp=log_probs.gather(-1, ids[..., None])[..., 0],
        logp_behavior=log_ref.gather(-1, ids[..., None])[..., 0].to(dtype),
        advantages=torch.tensor([1.0, -1.0]),
        mask=torch.ones(2, 3),
        token_ids=ids,
        logits=logits,
        logp_behavior_full=log_ref.to(dtype),
        logp_ref_full=log_ref.to(dtype),
    )
    return batch, logits, z, log_ref


def test_exact_kl_penalty_and_entropy_with_masked_vocabulary_columns():
    batch, logits, z, log_ref = masked_column_batch()
    cfg = gppo.preset("ppo", kl_coef=0.1, kl_estimator="full")
    loss, metrics = gppo.policy_loss(batch, cfg)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[..., 25:] == 0).all()
    keep = slice(0, 25)  # float64 reference on the unmasked columns only
    log_pi = torch.log_softmax(z[..., keep], -1)
    kl = (log_pi.exp() * (log_pi - log_ref[..., keep])).sum(-1).mean()
    entropy = -(log_pi.exp() * log_pi).sum(-1).mean()
    assert metrics["kl_ref"] == pytest.approx(kl.item(), rel=1e-5)
    assert metrics["entropy"] == pytest.approx(entropy.item(), rel=1e-5)


@pytest.mark.parametrize("field", ["logits", "logp_behavior_full", "logp_ref_full"])
def test_nan_in_full_distributions_is_refused(field):
    batch, _, _, _ = masked_column_batch()
    value = getattr(batch, field).detach().clone()
    value[1, 2, 3] = math.nan
    setattr(batch, field, value)
    with pytest.raises(gppo.GPPOInputError, match=f"TokenBatch.{field} has NaN"):
        gppo.policy_loss(batch, gppo.preset("dppo-topk-kl", estimator="full"))
    batch.mask[1, 2] = 0  # padding may hold anything
    gppo.policy_loss(batch, gppo.preset("dppo-topk-kl", estimator="full"))


def test_log_ratio_clamp_neither_admits_nor_freezes_a_huge_ratio():
    """q = 6.7e-10 and delta 0.9 give the upper bound hi = 1 + 0.9/q = 1.34e9 (binary TV); p = 0.99
    (r = 1.48e9) is beyond it, and beyond the +-20 clamp of log r (r = 4.9e8): it is outside the
    region, its gradient blocked by the rule, not zeroed by the clamp; a token inside at r = 5e8
    (p = 0.34) keeps its gradient. (Every p is a probability: log-probs above 0 are refused.)"""
    logq = torch.tensor([[math.log(6.7e-10)] * 2], dtype=torch.float64)
    logp = (logq + torch.tensor([[math.log(0.99 / 6.7e-10), math.log(5e8)]], dtype=torch.float64)).requires_grad_(True)
    batch = gppo.TokenBatch(logp=logp, logp_behavior=logq, advantages=torch.tensor([1.0]), mask=torch.ones(1, 2))
    cfg = gppo.preset("ppo", divergence="tv", estimator="binary", delta_low=0.9, delta_high=0.9)
    loss, metrics = gppo.policy_loss(batch, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == 0 and metrics["masked_frac"] == 0.5  # outside: blocked by the rule
    assert grad[0, 1] == pytest.approx(-math.exp(20) / 2)  # inside: gradient -A r / N, r clamped
    mask_cfg = gppo.preset("dppo-binary-tv", delta_low=0.9, delta_high=0.9)
    (grad,) = torch.autograd.grad(gppo.policy_loss(batch, mask_cfg)[0], logp)
    assert grad[0, 0] == 0 and grad[0, 1] != 0


@pytest.mark.parametrize("name,params", POINTS, ids=POINT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_closed_forms_match_the_generic_float64_sum(name, params, dtype):
    """Divergence.full_divergence (a closed form for the built-ins) against the float64 sum of
    cell terms, with -inf logit columns in pi, zero-probability cells in mu, and both at once."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 16, 3000
    z = 2 * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    z[:, :10] = -math.inf  # masked in pi and mu
    log_mu = torch.log_softmax(z + torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    z[:, 10:20] = -math.inf  # masked in pi only: where mu > 0, slope_at_inf decides
    log_mu[:, 20:30] = -math.inf  # zero in mu only
    log_mu = torch.log_softmax(log_mu, -1)
    div = gppo.divergence(name, **params)
    exact = div.between_log(torch.log_softmax(z, -1), log_mu)
    got = full_estimate(div, z.to(dtype)[:, None], log_mu.to(dtype)[:, None], torch.ones(n, 1), 512)[:, 0]
    assert got.dtype == dtype
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[~finite] == math.inf).all()
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.double()[finite], exact[finite], **tol)
    if name in ("tv", "hellinger", "js", "chi2", "alpha"):  # these stay finite where only mu is 0
        z[:, 10:20] = 0.0
        exact = div.between_log(torch.log_softmax(z, -1), log_mu)
        got = full_estimate(div, z.to(dtype)[:, None], log_mu.to(dtype)[:, None], torch.ones(n, 1), 7)[:, 0]
        finite = torch.isfinite(exact)
        torch.testing.assert_close(got.double()[finite], exact[finite], **tol)


@pytest.mark.parametrize("name,params", POINTS, ids=POINT_IDS)
def test_full_closed_forms_on_near_identical_distributions(name, params):
    """Tiny divergences (pi within 1e-3 of mu): float32 closed forms within a few eps of the
    exact value, and never negative."""
    log_pi, log_mu, _ = peaked(20_000, n=6, spread=1e-3)
    div = gppo.divergence(name, **params)
    exact = div.between_log(log_pi, log_mu)
    got = full_estimate(div, log_pi.float()[:, None], log_mu.float()[:, None], torch.ones(6, 1), 512)[:, 0]
    assert (got >= 0).all()
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=2e-6)


def test_a_user_divergence_falls_back_to_the_cell_sum():
    """A Divergence subclass without a closed form gets the generic exact sum."""
    from dataclasses import dataclass

    @dataclass(frozen=True, repr=False)
    class Triangular(gppo.Divergence):  # (t - 1)^2 / (t + 1): cell (p - q)^2 / (p + q)
        name: str = "triangular"
        f_tilde_at_0: float = 1.0
        slope_at_inf: float = 1.0

        def _interior(self, p, q, log_p, log_q):
            return (p - q) ** 2 / (p + q)

    log_pi, log_mu, _ = peaked(300, n=4, spread=1.0)
    got = full_estimate(Triangular(), log_pi.float()[:, None], log_mu.float()[:, None], torch.ones(4, 1), 512)
    expected = [
        sum((a - b) ** 2 / (a + b) for a, b in zip(p.tolist(), q.tolist())) for p, q in zip(log_pi.exp(), log_mu.exp())
    ]
    torch.testing.assert_close(got[:, 0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,params", POINTS, ids=POINT_IDS)
def test_cells_near_ratio_one_in_float32(name, params):
    """q f~(p/q) at log r in +-[1e-4, 1]: float32 within 1e-5 relative of float64 (JS was 5 %
    off at log r = 1e-3, alpha = 0.5 40 %)."""
    div = gppo.divergence(name, **params)
    log_q = torch.full((8,), math.log(0.3))
    x = torch.tensor([1e-4, -1e-4, 1e-3, -1e-3, 1e-2, -0.3, 0.7, -1.0])
    log_p32 = log_q + x
    got = div.cell_terms(log_p32, log_q).double()
    q = math.exp(float(log_q[0]))
    expected = [
        brute_force_divergence(name, [q * math.exp(xi)], [q], params.get("alpha", 0.5))
        - div.f_prime_at_1 * q * math.expm1(xi)
        for xi in (log_p32.double() - log_q.double()).tolist()
    ]
    if name == "tv":
        expected = [0.5 * abs(q * math.expm1(xi)) for xi in (log_p32.double() - log_q.double()).tolist()]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("alpha,limit", [(1e-7, "kl"), (-1e-7, "kl"), (1 - 1e-7, "rkl"), (1 + 1e-7, "rkl")])
def test_alpha_near_zero_and_one_tends_to_kl(alpha, limit):
    log_q = torch.log(torch.tensor([0.3, 0.3, 0.3, 0.3, 0.01]))
    log_p = torch.log(torch.tensor([0.3 * 1.001, 0.3 * 0.5, 0.3 * 3.0, 0.3 * 1e-4, 0.9]))
    got = gppo.divergence("alpha", alpha=alpha).cell_terms(log_p, log_q)
    expected = gppo.divergence(limit).cell_terms(log_p.double(), log_q.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


def cuda_inputs():
    gen = torch.Generator().manual_seed(5)
    z = 2 * torch.randn(40, 1, 700, generator=gen)
    z[..., :7] = -math.inf
    log_mu = torch.log_softmax(z.double() + torch.randn(40, 1, 700, generator=gen, dtype=torch.float64), -1)
    mask = torch.ones(40, 1)
    mask[3] = 0
    return z, log_mu.float(), mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,params", POINTS, ids=POINT_IDS)
def test_full_estimator_on_cuda_matches_float64(name, params):
    """The vocabulary kernel on CUDA against the float64 sum."""
    z, log_mu, mask = cuda_inputs()
    div = gppo.divergence(name, **params)
    got = full_estimate(div, z.cuda(), log_mu.cuda(), mask.cuda(), 8).cpu()
    exact = torch.where(mask.bool(), div.between_log(torch.log_softmax(z.double(), -1), log_mu.double()), 0.0)
    finite = torch.isfinite(exact)
    torch.testing.assert_close(got.double()[finite], exact[finite], rtol=1e-5, atol=2e-6)
    assert (got[~finite] == math.inf).all()


NEW_RULE_PRESETS = ["gpg", "dro", "kl-cov", "clip-cov", "vespo", "prime-dppo-kl", "icepop", "dr-grpo", "luspo"]


@pytest.mark.parametrize("name", NEW_RULE_PRESETS)
def test_new_rules_in_float32_match_float64(name):
    """The same batch rounded to float32: loss and gradient within float32 rounding of float64's
    (the covariance selections of kl-cov and clip-cov pick the same tokens)."""
    gen = torch.Generator().manual_seed(5)
    logq = torch.log(torch.rand(6, 9, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    logp = (logq + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 7, 1, 9, 5])[:, None]).double()
    results = []
    for dtype in (torch.float64, torch.float32):
        leaf = logp.to(dtype).requires_grad_(True)
        batch = gppo.TokenBatch(logp=leaf, logp_behavior=logq.to(dtype), advantages=adv.to(dtype), mask=mask.to(dtype))
        torch.manual_seed(0)
        loss, _ = gppo.policy_loss(batch, gppo.preset(name, **({"cov_ratio": 0.2} if "cov" in name else {})))
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.double(), grad.double()))
    assert_float32_matches_float64(results)


def assert_float32_matches_float64(results):
    """results = [(loss, grad) in float64, (loss, grad) in float32]: within float32 rounding."""
    (loss64, grad64), (loss32, grad32) = results
    assert grad64.abs().max() > 0
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad32, grad64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log_ratio", [20.0, -20.0])
def test_vespo_weight_at_extreme_sequence_ratios_in_float32(log_ratio):
    """A sequence of 64 tokens each at the +-20 clamp: log w = +-1280, far beyond float32's exp
    range. phi(w) = w^k e^(lambda (1 - w)) tends to 0 at both ends: the loss and gradient are 0
    there, not NaN, and a moderate sequence beside it keeps its gradient."""
    logq = torch.full((2, 64), -3.0)
    logp = torch.cat([torch.full((1, 64), -3.0 + log_ratio), torch.full((1, 64), -3.0)]).clamp(max=0.0)
    logq[0] = logp[0] - log_ratio
    logp = logp.requires_grad_(True)
    batch = gppo.TokenBatch(logp=logp, logp_behavior=logq, advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, 64))
    loss, _ = gppo.policy_loss(batch, gppo.preset("vespo"))
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[0] == 0).all() and (grad[1] != 0).all()
