"""ATR-GRPO (Wu et al. 2026, arXiv 2602.05494) is a point gppo already has: GRPO's clip with the
per-sample constraint KL3(w) = w - 1 - log w <= delta is gppo's kl x sample x clip, whose ratio
interval the paper writes with Lambert's W. Checked against an independent solution of
KL3(w) = delta (Newton's method, here) and a clipped-surrogate reference."""

import math

import pytest
import torch

import gppo
from tests.test_rules import assert_same, grad_of, loss_and_grad, random_batch


def kl3_roots(delta: float) -> tuple[float, float]:
    """The two w with w - 1 - log w = delta (the branches W_0 and W_-1 of -W(-e^(-1-delta))), by
    Newton's method from either side; monotone convergence, as the function is convex."""
    roots = []
    for w in (1e-12, 1.0 + 3 * math.sqrt(delta) + 2 * delta):
        for _ in range(200):
            w -= (w - 1 - math.log(w) - delta) / (1 - 1 / w)
        roots.append(w)
    return roots[0], roots[1]


def atr_grpo_reference(logp, logq, adv, mask, lo, hi):
    """-min(w A, clip(w, lo, hi) A), GRPO's sequence-mean of token-means."""
    w = torch.exp(logp - logq)
    a = adv[:, None].expand_as(w)
    per_token = -torch.minimum(w * a, w.clamp(lo, hi) * a) * mask
    return (per_token.sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("delta", [0.02, 0.05, 0.2])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl3_clipping_is_kl_sample_clip(delta, seed):
    lo, hi = kl3_roots(delta)
    assert abs(lo - 1 - math.log(lo) - delta) < 1e-12 and abs(hi - 1 - math.log(hi) - delta) < 1e-12
    assert hi - 1 > 1 - lo  # asymmetric: more room above 1 than below
    batch, _, _ = random_batch(seed=seed, spread=1.0)
    cfg = gppo.preset("grpo", divergence="kl", estimator="sample", delta_low=delta, delta_high=delta)
    w = torch.exp(batch.logp - batch.logp_behavior)[batch.mask.bool()]
    assert (w < lo).any() and (w > hi).any()  # both ends of the interval bind
    loss, grad, _ = loss_and_grad(batch, cfg)
    expected = atr_grpo_reference(batch.logp, batch.logp_behavior, batch.advantages, batch.mask, lo, hi)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
