"""gppo.theory: ratio intervals against closed forms, geometry scaling, improvement bounds."""

import math

import numpy as np
import pytest
import torch

import gppo
from gppo import theory

Q = np.array([1e-4, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.9])


def test_tv_sample_is_ppo_clip():
    lo, hi = theory.ratio_interval("tv", "sample", Q, 0.1, 0.14)
    np.testing.assert_allclose(lo, 0.8)
    np.testing.assert_allclose(hi, np.minimum(1.28, 1 / Q))  # p = r q never exceeds 1


def test_chi2_cell_is_ripo():
    lo, hi = theory.ratio_interval("chi2", "cell", Q, 0.05)
    width = np.sqrt(0.05 / Q)
    np.testing.assert_allclose(lo, np.clip(1 - width, 0, None), rtol=1e-9)
    np.testing.assert_allclose(hi, np.minimum(1 + width, 1 / Q), rtol=1e-9)


def test_tv_binary_is_absolute_probability_change():
    lo, hi = theory.ratio_interval("tv", "binary", Q, 0.15)
    np.testing.assert_allclose(lo, np.clip(1 - 0.15 / Q, 0, None), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(hi, np.minimum(1 + 0.15 / Q, 1 / Q), rtol=1e-8)


def test_chi2_binary_closed_form():
    lo, hi = theory.ratio_interval("chi2", "binary", Q, 0.05)
    width = np.sqrt(0.05 * (1 - Q) / Q)  # (p-q)^2 / (q (1-q)) <= delta
    np.testing.assert_allclose(lo, np.clip(1 - width, 0, None), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(hi, np.minimum(1 + width, 1 / Q), rtol=1e-8)


@pytest.mark.parametrize("name", ["kl", "rkl", "neyman", "hellinger", "js"])
@pytest.mark.parametrize("estimator", ["sample", "cell", "binary"])
def test_intervals_solve_the_boundary_equation(name, estimator):
    """At a finite bound the estimate equals delta exactly (found by bisection or closed form)."""
    div = gppo.divergence(name)
    delta = 0.05
    lo, hi = theory.ratio_interval(name, estimator, Q, delta)
    for q, low, h in zip(Q, lo, hi):
        for r, interior in ((low, low > 0), (h, h < 1 / q * (1 - 1e-12))):
            if not interior:
                continue
            logq = torch.tensor(math.log(q), dtype=torch.float64)
            logp = logq + math.log(r)
            if estimator == "sample":
                value = div.f_normalized(torch.tensor(r, dtype=torch.float64))
            elif estimator == "cell":
                value = div.cell_terms(logp, logq)
            else:
                value = div.between(
                    torch.tensor([q * r, 1 - q * r], dtype=torch.float64), torch.tensor([q, 1 - q], dtype=torch.float64)
                )
            assert value.item() == pytest.approx(delta, rel=1e-6)
        assert low <= 1 <= h


def test_geometry_scaling_with_probability():
    """PPO's interval is constant, RIPO's half-width grows like q^-1/2, binary TV's like q^-1."""
    q = np.array([1e-4, 1e-3])
    geo = theory.geometry(["tv", "chi2"], ["sample", "cell", "binary"], q, 0.01)
    ppo_lo, ppo_hi = geo[("tv", "sample")]
    assert ppo_hi[0] == ppo_hi[1]
    _, ripo_hi = geo[("chi2", "cell")]
    assert (ripo_hi[0] - 1) / (ripo_hi[1] - 1) == pytest.approx(math.sqrt(10), rel=1e-6)
    _, tv_hi = geo[("tv", "binary")]
    assert (tv_hi[0] - 1) / (tv_hi[1] - 1) == pytest.approx(10, rel=1e-6)


def test_improvement_bounds():
    # KL radius 0.02 -> TV <= 0.1 (Pinsker); DPPO: min(2 xi T (T-1) 0.01, 4 xi T 0.1)
    assert theory.tv_radius("kl", 0.02) == pytest.approx(0.1)
    assert theory.improvement_bound("kl", 0.02, xi=1.0, horizon=10, surrogate=5.0) == pytest.approx(5.0 - 1.8)
    assert theory.improvement_bound("kl", 0.02, xi=1.0, horizon=1000) == pytest.approx(-400.0)
    # discounted: DPPO Theorem 2.1, 2 xi gamma / (1 - gamma)^2 TV^2, and TRPO Theorem 1, 4 eps gamma /
    # (1 - gamma)^2 alpha^2; TV radius 0.1, xi = eps = 2, gamma = 0.9: 2 * 2 * 0.9 / 0.01 * 0.01 = 3.6
    assert theory.improvement_bound("tv", 0.1, xi=2.0, gamma=0.9) == pytest.approx(-3.6)
    assert theory.improvement_bound("tv", 0.1, xi=2.0, gamma=0.9, bound="dppo") == pytest.approx(-3.6)
    assert theory.improvement_bound("tv", 0.1, xi=2.0, gamma=0.9, bound="trpo") == pytest.approx(-7.2)
    assert theory.improvement_bound("kl", 0.02, xi=1.0, gamma=0.5, surrogate=1.0, bound="trpo") == pytest.approx(
        1.0 - 4 * 1.0 * 0.5 / 0.25 * 0.01
    )
    with pytest.raises(ValueError, match="give gamma"):
        theory.improvement_bound("tv", 0.1, xi=1.0, horizon=10, bound="trpo")
    with pytest.raises(ValueError, match="choose 'dppo'"):
        theory.improvement_bound("tv", 0.1, xi=1.0, gamma=0.9, bound="achiam")
    # a looser region never gives a better guarantee, for every divergence, past delta = 2 too
    for name in ("tv", "kl", "rkl", "chi2", "neyman", "hellinger", "js", "alpha"):
        bounds = [theory.improvement_bound(name, d, xi=1.0, gamma=0.9) for d in (0.01, 1.0, 2.0, 3.0, 4.0, 9.0)]
        assert all(a >= b for a, b in zip(bounds, bounds[1:])), (name, bounds)
        assert bounds[-1] < 0
    # a larger radius never gives a better guarantee
    for name in ("tv", "kl", "chi2", "hellinger", "js"):
        bounds = [theory.improvement_bound(name, d, xi=1.0, horizon=100) for d in (0.001, 0.01, 0.1)]
        assert bounds[0] >= bounds[1] >= bounds[2]
    with pytest.raises(ValueError, match="exactly one"):
        theory.improvement_bound("tv", 0.1, xi=1.0)


@pytest.mark.parametrize("name", ["tv", "kl", "chi2", "hellinger", "js"])
@pytest.mark.parametrize("estimator", ["sample", "cell", "binary"])
def test_matched_radii_give_the_reference_interval(name, estimator):
    """At q = 0.5 every matched (divergence, estimator) allows exactly TV's [1 - 2 delta, 1 + 2 delta]."""
    low, high = theory.matched_radii(name, estimator, 0.15)
    lo, hi = theory.ratio_interval(name, estimator, [0.5], low, high)
    assert lo[0] == pytest.approx(0.7, rel=1e-6) and hi[0] == pytest.approx(1.3, rel=1e-6)
    assert theory.matched_radii("tv", "binary", 0.15) == pytest.approx((0.15, 0.15))
    assert theory.matched_radii("chi2", "cell", 0.15) == pytest.approx((0.045, 0.045))  # q (2 delta)^2
    assert theory.matched_radii(name, "topk", 0.15) == theory.matched_radii(name, "binary", 0.15)
    with pytest.raises(ValueError, match="delta must be in"):
        theory.matched_radii(name, estimator, 0.5)
