"""CPPO (2606.10968) and DRPO (2606.09821) against references written from the papers' equations,
sharing no code with gppo.core: CPPO as its Algorithm 1 (a loop over each response's tokens, the
90th percentile by torch.quantile), DRPO as its Eq. 8 and, on gradients, its Table 1 weight.
Loss and gradient in float64 with every branch of each rule exercised; float32 against float64;
the new parameters' validation."""

import pytest
import torch

import gppo
from tests.test_float32 import assert_float32_matches_float64
from tests.test_rules import assert_same, grad_of, loss_and_grad, random_batch

SEEDS = [0, 1, 2]


def binary_tv(batch):
    return (batch.logp.detach().exp() - batch.logp_behavior.exp()).abs()


def topk_tv(batch, log_pi, log_mu, k):
    """TV between pi and mu coarse-grained to mu's top-k tokens, the sampled token and the rest."""
    B, T, V = log_mu.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            cells = set(log_mu[i, t].topk(k).indices.tolist()) | {int(batch.token_ids[i, t])}
            p, q = log_pi[i, t].exp(), log_mu[i, t].exp()
            inside = torch.tensor(sorted(cells))
            rest = abs((1 - p[inside].sum()) - (1 - q[inside].sum()))
            out[i, t] = 0.5 * ((p[inside] - q[inside]).abs().sum() + rest)
    return out


def cppo_keep(div, adv, log_ratio, mask, delta, w_min, budget, mode):
    """Algorithm 1 of the CPPO paper, response by response; returns the kept tokens and, per token,
    why: 'toward' (A (r - 1) <= 0), 'inside', 'token' (w D > delta) or 'prefix' (masked by the
    prefix budget alone)."""
    B, T = div.shape
    keep = torch.ones(B, T)
    why = {}
    for i in range(B):
        n = int(mask[i].sum())
        d = div[i, :n]
        b = budget if mode == "fixed" else float(torch.quantile(d, 0.9).clamp(budget, 2 * budget))
        s = w_sum = 0.0
        for t in range(1, n + 1):
            w = 1.0 if n == 1 else 1 - (1 - w_min) * (t - 1) / (n - 1)
            z = w * float(d[t - 1])
            threshold = min(delta, delta + b * w_sum - s)
            toward = float(adv[i]) * (float(log_ratio[i, t - 1].exp()) - 1) <= 0
            if toward:
                why[i, t - 1] = "toward"
            elif z <= threshold:
                why[i, t - 1] = "inside"
            else:
                keep[i, t - 1] = 0.0
                why[i, t - 1] = "token" if z > delta else "prefix"
            s += z
            w_sum += w
    return keep, why


def cppo_loss(batch, keep):
    """Eq. 11: -M r A, token-mean."""
    ratio = (batch.logp - batch.logp_behavior).exp()
    mask = batch.mask
    return (-keep * ratio * batch.advantages[:, None] * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["binary", "topk"])
@pytest.mark.parametrize("mode", ["fixed", "p90"])
def test_cppo_matches_algorithm_1(seed, estimator, mode):
    batch, log_pi, log_mu = random_batch(B=8, T=12, seed=seed, spread=0.8)
    div = binary_tv(batch) if estimator == "binary" else topk_tv(batch, log_pi, log_mu, 5)
    p90 = torch.stack([torch.quantile(div[i, : int(n)], 0.9) for i, n in enumerate(batch.mask.sum(-1))])
    # p90: a budget that leaves some responses' percentile inside [budget, 2 budget], some clamped
    delta, w_min, budget = 0.15, 0.8, (0.03 if mode == "fixed" else 0.75 * float(p90.median()))
    config = gppo.preset(
        "cppo",
        estimator=estimator,
        delta_high=delta,
        prefix_budget=budget,
        prefix_budget_mode=mode,
        **({"top_k": 5} if estimator == "topk" else {}),
    )
    keep, why = cppo_keep(
        div, batch.advantages, batch.logp.detach() - batch.logp_behavior, batch.mask, delta, w_min, budget, mode
    )
    # every branch occurs: the prefix budget binds (fixed), the percentile is clamped or not (p90)
    assert {"toward", "inside", "token", "prefix" if mode == "fixed" else "token"} <= set(why.values())
    if mode == "p90":
        inside = (p90 > budget) & (p90 < 2 * budget)
        assert inside.any() and not inside.all()
    loss, grad, metrics = loss_and_grad(batch, config)
    expected = cppo_loss(batch, keep)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    masked = 1 - (keep * batch.mask).sum() / batch.mask.sum()
    assert metrics["masked_frac"] == pytest.approx(float(masked))


def test_cppo_reduces_to_dppo_without_position_weight_or_budget():
    """w_min = 1 and a budget too large to bind: CPPO is DPPO's mask with the single radius delta."""
    batch, _, _ = random_batch(B=8, T=12, seed=3, spread=0.8)
    _, grad, _ = loss_and_grad(
        batch, gppo.preset("cppo", estimator="binary", position_weight_min=1.0, prefix_budget=10.0)
    )
    _, dppo, _ = loss_and_grad(batch, gppo.preset("dppo-binary-tv"))
    assert_same(grad, dppo)
    _, tighter, _ = loss_and_grad(
        batch, gppo.preset("cppo", estimator="binary", position_weight_min=1.0, prefix_budget=0.01)
    )
    assert not torch.allclose(tighter, dppo)  # the budget binds


def drpo_loss(batch, delta):
    """Eq. 8 per token, -A r + |A| mu (r - 1)^2 / (2 delta), summed per response over the batch's T
    positions (seq-mean-token-sum-norm, the authors' recipe) and averaged over responses."""
    ratio = (batch.logp - batch.logp_behavior).exp()
    adv = batch.advantages[:, None]
    per_token = -adv * ratio + adv.abs() * batch.logp_behavior.exp() * (ratio - 1) ** 2 / (2 * delta)
    B, T = batch.mask.shape
    return (per_token * batch.mask).sum() / (B * T)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("delta", [12.5, 0.1])
def test_drpo_matches_eq_8_and_its_table_1_weight(seed, delta):
    batch, _, _ = random_batch(B=8, T=12, seed=seed, spread=0.8)
    loss, grad, _ = loss_and_grad(batch, gppo.preset("drpo", quadratic_delta=delta))
    expected = drpo_loss(batch, delta)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))
    # Table 1: d loss / d log pi = -A r (1 - sign(A (r - 1)) |pi - mu| / delta) / (B T)
    ratio = (batch.logp.detach() - batch.logp_behavior).exp()
    adv = batch.advantages[:, None]
    weight = 1 - torch.sign(adv * (ratio - 1)) * binary_tv(batch) / delta
    B, T = batch.mask.shape
    assert_same(grad, -adv * ratio * weight * batch.mask / (B * T))
    valid = batch.mask.bool()
    assert (weight[valid] < 1).any() and (weight[valid] > 1).any()  # diverging and converging tokens
    if delta < 1:
        assert (weight[valid] < 0).any()  # corrective beyond the boundary |pi - mu| = delta


@pytest.mark.parametrize("name,overrides", [("drpo", {}), ("cppo", {}), ("cppo", {"prefix_budget_mode": "p90"})])
def test_cppo_and_drpo_in_float32_match_float64(name, overrides):
    batch, _, _ = random_batch(B=8, T=12, seed=4, spread=0.8)
    config = gppo.preset(name, top_k=5, **overrides) if name == "cppo" else gppo.preset(name)
    results = []
    for dtype in (torch.float64, torch.float32):
        fields = {
            k: (v.to(dtype) if torch.is_floating_point(v) else v)
            for k, v in vars(batch).items()
            if isinstance(v, torch.Tensor) and k != "logp"
        }
        leaf = batch.logp.detach().to(dtype).requires_grad_(True)
        loss, _ = gppo.policy_loss(gppo.TokenBatch(logp=leaf, **fields), config)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.double(), grad.double()))
    assert_float32_matches_float64(results)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("position_weight_min", 0.0, "in (0, 1]"),
        ("position_weight_min", 1.5, "in (0, 1]"),
        ("prefix_budget", -0.1, "> 0 and finite"),
        ("prefix_budget_mode", "median", "fixed"),
    ],
)
def test_cppo_parameters_are_validated(field, value, expected):
    with pytest.raises(gppo.GPPOConfigError, match=field) as err:
        gppo.preset("cppo", **{field: value})
    assert expected in str(err.value)


def test_drpo_parameter_is_validated_and_not_taken_by_other_rules():
    with pytest.raises(gppo.GPPOConfigError, match="quadratic_delta"):
        gppo.preset("drpo", quadratic_delta=0.0)
    with pytest.raises(gppo.GPPOConfigError, match="quadratic_delta"):
        gppo.preset("dppo-binary-tv", quadratic_delta=1.0)
