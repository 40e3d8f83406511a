"""The behavior weight sg[pi_old/mu] in TRL's four vllm_importance_sampling_mode forms: gppo's
behavior_weight_mode / _floor / _cap against TRL's own lines (GRPOTrainer._generate_and_score_completions,
run as written), applied to an independent PPO-clip reference around pi_old (loss and gradient, float64)."""

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

import gppo
from tests.test_rules import assert_same, grad_of, loss_and_grad, random_batch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_weight(logp_old, logp_behavior, mask, mode, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio, by executing the block of its trainer that computes it."""
    trl = pytest.importorskip("trl")
    lines = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions).splitlines()
    start = next((i for i, line in enumerate(lines) if "per_token_logps_diff = (old_per_token_logps" in line), None)
    stop = next((i for i, line in enumerate(lines) if "Unknown vLLM importance sampling level" in line), None)
    if start is None or stop is None:
        pytest.skip("this TRL version computes the vLLM importance-sampling ratio elsewhere")
    namespace = dict(
        torch=torch,
        math=math,
        old_per_token_logps=logp_old,
        sampling_per_token_logps=logp_behavior,
        mask=mask,
        self=SimpleNamespace(
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
        ),
    )
    exec(textwrap.dedent("\n".join(lines[start : stop + 2])), namespace)  # through the raise's closing line
    return namespace["vllm_importance_sampling_ratio"]


def ppo_clip_around_old(logp, logp_old, adv, mask, eps, weight):
    """-min(r A, clip(r, 1 - eps, 1 + eps) A) * weight, r = pi / pi_old, token-mean."""
    r = torch.exp(logp - logp_old)
    a = adv[:, None].expand_as(r)
    per_token = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a) * weight
    return (per_token * mask).sum() / mask.sum()


def batch_with_old(seed):
    batch, _, _ = random_batch(seed=seed, spread=0.5)
    noise = torch.randn(batch.logp.shape, generator=torch.Generator().manual_seed(seed + 10), dtype=torch.float64)
    batch.logp_old = (batch.logp_behavior + 0.3 * noise).clamp(max=-1e-6)  # log-probs stay <= 0
    return batch


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("floor,cap", [(None, 1.2), (0.8, None), (0.8, 1.2), (0.5, 2.0)])
def test_behavior_weight_modes_equal_trl(seed, mode, floor, cap):
    batch = batch_with_old(seed)
    weight = trl_weight(batch.logp_old, batch.logp_behavior, batch.mask, mode, floor, cap)
    cfg = gppo.preset(
        "ppo", anchor="old", behavior_weight_mode=mode, behavior_weight_floor=floor, behavior_weight_cap=cap
    )
    loss, grad, _ = loss_and_grad(batch, cfg)
    expected = ppo_clip_around_old(batch.logp, batch.logp_old, batch.advantages, batch.mask, 0.2, weight)
    assert_same(loss, expected)
    assert_same(grad, grad_of(expected, batch))


@pytest.mark.parametrize("level,band", [("token", (0.8, 1.2)), ("sequence", (0.5, 2.0))])
def test_every_branch_of_the_band_is_exercised(level, band):
    """The batches above have weights below the floor, above the cap and inside the band."""
    ratios = []
    for seed in (0, 1, 2):
        batch = batch_with_old(seed)
        ratio = trl_weight(batch.logp_old, batch.logp_behavior, batch.mask, f"{level}_mask", None, None)
        ratios.append(ratio.expand_as(batch.mask)[batch.mask.bool()])
    ratio = torch.cat(ratios)
    assert (ratio < band[0]).any() and (ratio > band[1]).any() and ((ratio >= band[0]) & (ratio <= band[1])).any()


def test_token_truncate_without_floor_is_the_cap_alone():
    batch = batch_with_old(3)
    a, ga, _ = loss_and_grad(batch, gppo.preset("ppo", anchor="old", behavior_weight_cap=1.1))
    b, gb, _ = loss_and_grad(
        batch, gppo.preset("ppo", anchor="old", behavior_weight_cap=1.1, behavior_weight_mode="token_truncate")
    )
    assert_same(a, b)
    assert_same(ga, gb)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(behavior_weight_mode="token_clip", behavior_weight_cap=2.0, anchor="old"),
            r"behavior_weight_mode='token_clip' is not valid.*token_mask",
        ),
        (dict(behavior_weight_mode="sequence_mask"), r"behavior_weight_mode='sequence_mask' has no band"),
        (dict(behavior_weight_floor=0.5), r"behavior_weight_floor corrects pi_old vs mu and needs anchor='old'"),
        (
            dict(behavior_weight_floor=2.0, behavior_weight_cap=1.5, anchor="old"),
            r"behavior_weight_floor=2.0 must be <= behavior_weight_cap=1.5",
        ),
        (dict(behavior_weight_floor=-1.0, anchor="old"), r"behavior_weight_floor must be >= 0 and finite"),
        (dict(behavior_weight_floor=math.nan, anchor="old"), r"behavior_weight_floor must be >= 0 and finite"),
    ],
)
def test_bad_behavior_weights_are_refused(overrides, message):
    with pytest.raises(gppo.GPPOConfigError, match=message):
        gppo.preset("ppo", **overrides)


def test_float32_weights_match_float64():
    batch = batch_with_old(4)
    cfg = gppo.preset(
        "ppo", anchor="old", behavior_weight_mode="sequence_mask", behavior_weight_floor=0.5, behavior_weight_cap=2.0
    )
    loss64, _, _ = loss_and_grad(batch, cfg)
    single = gppo.TokenBatch(
        logp=batch.logp.detach().float().requires_grad_(True),
        logp_behavior=batch.logp_behavior.float(),
        advantages=batch.advantages.float(),
        mask=batch.mask.float(),
    )
    single.logp_old = batch.logp_old.float()
    loss32, _, _ = loss_and_grad(single, cfg)
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-6)
