"""Divergence axis: every D_f against a brute-force float64 sum, generators, limits, TV bounds."""

import math

import numpy as np
import pytest
import torch

import gppo
from tests.reference import brute_force_divergence, generator

NAMES = list(gppo.DIVERGENCES)
ALPHAS = [-0.5, 0.5, 1.5, 2.0]


def all_divergences():
    """(label, divergence object, reference name, alpha) for every divergence and a few alphas."""
    out = [(n, gppo.divergence(n), n, None) for n in NAMES if n != "alpha"]
    out += [(f"alpha={a}", gppo.divergence("alpha", alpha=a), "alpha", a) for a in ALPHAS]
    return out


DIVS = all_divergences()
IDS = [d[0] for d in DIVS]


def random_pairs(seed, vocab, zeros):
    """Probability vectors p, q (float64) with some zero cells in p, in q and in both."""
    gen = np.random.default_rng(seed)
    p, q = gen.dirichlet(np.full(vocab, 0.7)), gen.dirichlet(np.full(vocab, 0.7))
    if zeros:
        p[0] = 0.0  # p = 0 < q
        q[1] = 0.0  # q = 0 < p
        p[2] = q[2] = 0.0  # both zero
        p, q = p / p.sum(), q / q.sum()
    return p, q


@pytest.mark.parametrize("label,div,ref,alpha", DIVS, ids=IDS)
@pytest.mark.parametrize("vocab,zeros", [(2, False), (5, False), (17, False), (6, True), (40, True)])
def test_between_matches_brute_force(label, div, ref, alpha, vocab, zeros):
    for seed in range(3):
        p, q = random_pairs(seed, vocab, zeros)
        expected = brute_force_divergence(ref, p, q, alpha if alpha is not None else 0.5)
        got = div.between(torch.tensor(p), torch.tensor(q)).item()
        if math.isinf(expected):
            assert got == math.inf
        else:
            assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("label,div,ref,alpha", DIVS, ids=IDS)
def test_between_is_batched_over_leading_axes(label, div, ref, alpha):
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, 9, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(3, 4, 9, generator=gen, dtype=torch.float64), -1)
    batched = div.between(p, q)
    assert batched.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            assert batched[i, j].item() == pytest.approx(
                brute_force_divergence(ref, p[i, j], q[i, j], alpha or 0.5), rel=1e-9
            )


@pytest.mark.parametrize("label,div,ref,alpha", DIVS, ids=IDS)
def test_generator_and_normalised_generator(label, div, ref, alpha):
    t = torch.cat([torch.zeros(1), torch.logspace(-6, 6, 200), torch.ones(1)]).double()
    f_ref = generator(ref, alpha if alpha is not None else 0.5)
    f = div.f(t)
    for ti, fi in zip(t.tolist(), f.tolist()):
        expected = f_ref(ti)
        if math.isinf(expected):
            assert fi == math.inf
        else:
            assert fi == pytest.approx(expected, rel=1e-8, abs=1e-12)
    f_tilde = div.f_normalized(t)
    assert (f_tilde >= 0).all()
    assert div.f_normalized(torch.tensor(1.0)).item() == 0.0
    assert div.f(torch.tensor(1.0)).item() == pytest.approx(0.0, abs=1e-15)
    # f~ = f - f'(1)(t - 1): the normalisation removes exactly the slope at 1
    finite = torch.isfinite(f)
    torch.testing.assert_close(f_tilde[finite], (f - div.f_prime_at_1 * (t - 1))[finite])


@pytest.mark.parametrize("label,div,ref,alpha", [d for d in DIVS if d[2] != "tv"], ids=IDS[1:])
def test_curvature_is_second_derivative_at_one(label, div, ref, alpha):
    f_ref = generator(ref, alpha if alpha is not None else 0.5)
    h = 1e-4
    second = (f_ref(1 + h) - 2 * f_ref(1) + f_ref(1 - h)) / h**2
    assert div.curvature == pytest.approx(second, rel=1e-4)
    slope = (f_ref(1 + h) - f_ref(1 - h)) / (2 * h)
    assert div.f_prime_at_1 == pytest.approx(slope, abs=1e-6)


def test_alpha_family_special_cases():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(20, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(20, generator=gen, dtype=torch.float64), -1)
    chi2 = gppo.divergence("chi2").between(p, q)
    hellinger = gppo.divergence("hellinger").between(p, q)
    assert gppo.divergence("alpha", alpha=2.0).between(p, q).item() == pytest.approx(chi2.item() / 2)
    assert gppo.divergence("alpha", alpha=0.5).between(p, q).item() == pytest.approx(2 * hellinger.item())
    kl = gppo.divergence("kl").between(p, q).item()
    rkl = gppo.divergence("rkl").between(p, q).item()
    assert gppo.divergence("alpha", alpha=1e-5).between(p, q).item() == pytest.approx(kl, rel=1e-3)
    assert gppo.divergence("alpha", alpha=1 - 1e-5).between(p, q).item() == pytest.approx(rkl, rel=1e-3)


@pytest.mark.parametrize("label,div,ref,alpha", DIVS, ids=IDS)
def test_stable_from_log_probabilities(label, div, ref, alpha):
    """Zero cells given as -inf, tiny and huge ratios, float32 and float64: never NaN."""
    log_p = torch.tensor([-math.inf, -80.0, -1e-9, -0.5, -40.0, -math.inf])
    log_q = torch.tensor([-0.1, -math.inf, -1e-9, -0.7, -1e-3, -math.inf])
    for dtype in (torch.float32, torch.float64):
        terms = div.cell_terms(log_p.to(dtype), log_q.to(dtype))
        assert not torch.isnan(terms).any()
        assert (terms >= 0).all()
        assert terms[-1] == 0  # 0 f(0/0) = 0
    # float32 agrees with float64 in absolute terms on ordinary distributions
    gen = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(64, 300, generator=gen, dtype=torch.float64) * 3, -1)
    lq = torch.log_softmax(torch.randn(64, 300, generator=gen, dtype=torch.float64) * 3, -1)
    exact = div.between_log(lp, lq)
    single = div.between_log(lp.float(), lq.float()).double()
    finite = torch.isfinite(exact)
    torch.testing.assert_close(single[finite], exact[finite], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("label,div,ref,alpha", DIVS, ids=IDS)
def test_large_zipf_vocabulary(label, div, ref, alpha):
    vocab = 50_000
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    q = ranks**-1.1 / (ranks**-1.1).sum()
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    p = 0.9 * q + 0.1 * q[perm]  # a nearby Zipf-like distribution
    got = div.between(p, q).item()
    expected = brute_force_divergence(ref, p.tolist(), q.tolist(), alpha if alpha is not None else 0.5)
    assert got == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize(
    "label,div,ref,alpha",
    [d for d in DIVS if d[3] is None or -1 <= d[3] <= 2],
    ids=[d[0] for d in DIVS if d[3] is None or -1 <= d[3] <= 2],
)
def test_tv_bound_holds(label, div, ref, alpha):
    tv = gppo.divergence("tv")
    for seed in range(30):
        p, q = random_pairs(seed, 8, zeros=False)
        if seed % 3 == 0:  # far apart distributions too
            p = np.roll(p, 3)
        p, q = torch.tensor(p), torch.tensor(q)
        assert tv.between(p, q).item() <= div.tv_bound(div.between(p, q).item()) + 1e-12


@pytest.mark.parametrize(
    "label,div,ref,alpha",
    [d for d in DIVS if d[3] is None or -1 <= d[3] <= 2],
    ids=[d[0] for d in DIVS if d[3] is None or -1 <= d[3] <= 2],
)
def test_tv_bound_is_non_decreasing_and_at_most_one(label, div, ref, alpha):
    """A looser region never gets a tighter TV bound (Hellinger's Le Cam bound fell after
    delta = 2 and reached 0 at delta = 4)."""
    deltas = [0.0, 1e-6, 0.01, 0.1, 0.5, 1.0, 1.9, 2.0, 2.1, 3.0, 4.0, 10.0, 1e6, math.inf]
    bounds = [div.tv_bound(d) for d in deltas]
    assert all(0.0 <= b <= 1.0 for b in bounds)
    assert all(a <= b for a, b in zip(bounds, bounds[1:])), bounds
    assert bounds[-1] == 1.0


def test_hellinger_tv_bound_closed_form():
    h = gppo.divergence("hellinger")
    for h2 in (0.01, 0.5, 1.0, 1.5):  # TV <= H sqrt(1 - H^2 / 4), H^2 the squared Hellinger
        assert h.tv_bound(h2) == pytest.approx(math.sqrt(h2) * math.sqrt(1 - h2 / 4))
    assert h.tv_bound(2.0) == pytest.approx(1.0) and h.tv_bound(4.0) == 1.0


def test_tv_bound_values():
    assert gppo.divergence("kl").tv_bound(0.08) == pytest.approx(0.2)  # Pinsker sqrt(0.08/2)
    assert gppo.divergence("chi2").tv_bound(0.16) == pytest.approx(0.2)
    assert gppo.divergence("tv").tv_bound(5.0) == 1.0


def test_unknown_and_bad_parameters():
    with pytest.raises(ValueError, match="did you mean 'hellinger'"):
        gppo.divergence("helinger")
    with pytest.raises(ValueError, match="alpha"):
        gppo.divergence("alpha", alpha=1.0)
    with pytest.raises(ValueError, match="takes no parameters"):
        gppo.divergence("kl", alpha=0.3)
    with pytest.raises(ValueError, match="no TV bound"):
        gppo.divergence("alpha", alpha=3.0).tv_bound(0.1)
