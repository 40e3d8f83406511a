"""Tool tokens inside a response (a code interpreter's output spliced into the completion) are
context, never a term of the objective: with mask = 0 at their positions, every preset's loss,
gradient and metrics equal those of the same rollout with the tool spans cut out by hand (the
independent reference here), whatever values the tool positions hold.
"""

import math
import zlib

import pytest
import torch

import gppo

B, T, V, K = 3, 6, 11, 3
TOOL_SPANS = {0: (2, 4), 1: (1, 2), 2: (4, 7)}  # row -> (insert at, number of tool tokens)


def distributions(gen, rows, positions, scale=1.0):
    log_mu = torch.log_softmax(3.0 * torch.randn(rows, positions, V, generator=gen), -1)
    log_pi = torch.log_softmax(log_mu + scale * torch.randn(rows, positions, V, generator=gen), -1)
    log_old = torch.log_softmax(log_mu + scale / 2 * torch.randn(rows, positions, V, generator=gen), -1)
    log_ref = torch.log_softmax(log_mu + scale * torch.randn(rows, positions, V, generator=gen), -1)
    return log_mu, log_pi, log_old, log_ref


def with_tool_spans(compact: torch.Tensor, junk: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B, T + max span, ...]: each row's tool span (from `junk`) inserted at its
    position, then padding (also from `junk`) up to the common width."""
    width = T + max(n for _, n in TOOL_SPANS.values())
    rows = []
    for row, (at, n) in TOOL_SPANS.items():
        pieces = [compact[row, :at], junk[row, at : at + n], compact[row, at:]]
        filled = torch.cat(pieces)
        rows.append(torch.cat([filled, junk[row, filled.shape[0] : width]]))
    return torch.stack(rows)


def model_positions() -> torch.Tensor:
    width = T + max(n for _, n in TOOL_SPANS.values())
    keep = torch.zeros(B, width, dtype=torch.bool)
    for row, (at, n) in TOOL_SPANS.items():
        keep[row, :at] = True
        keep[row, at + n : T + n] = True
    return keep


def batch_from(log_mu, log_pi_leaf, log_old, log_ref, ids, adv, mask):
    log_pi = torch.log_softmax(log_pi_leaf, -1)
    top_logq, top_ids = log_mu.topk(K, -1)
    pick = ids[..., None]
    return gppo.TokenBatch(
        logp=log_pi.gather(-1, pick)[..., 0],
        logp_behavior=log_mu.gather(-1, pick)[..., 0],
        advantages=adv,
        mask=mask,
        logp_old=log_old.gather(-1, pick)[..., 0],
        token_ids=ids,
        topk_ids=top_ids,
        topk_logp_behavior=top_logq,
        topk_logp=log_pi.gather(-1, top_ids),
        topk_logp_old=log_old.gather(-1, top_ids),
        logits=log_pi_leaf,
        logp_behavior_full=log_mu,
        logp_old_full=log_old,
        logp_ref=log_ref.gather(-1, pick)[..., 0],
        logp_ref_full=log_ref,
    )


@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("kl", [0.0, 0.05])
@pytest.mark.parametrize("name", sorted(gppo.PRESETS))
def test_tool_tokens_are_no_term_of_any_preset(name, kl, per_token_advantages):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    log_mu, log_pi, log_old, log_ref = distributions(gen, B, T)
    ids = torch.multinomial(log_mu.exp().view(-1, V), 1, generator=gen).view(B, T)
    adv = torch.randn((B, T) if per_token_advantages else (B,), generator=gen)
    lengths = torch.tensor([T, T - 2, T - 1])  # trailing padding too
    mask = (torch.arange(T) < lengths[:, None]).float()

    width = T + max(n for _, n in TOOL_SPANS.values())
    junk_mu, junk_pi, junk_old, junk_ref = distributions(gen, B, width, scale=5.0)
    junk_ids = torch.randint(V, (B, width), generator=gen)
    keep = model_positions()

    config = gppo.preset(name, kl_coef=kl, kl_estimator="k3" if kl else "k1")
    if config.loss_agg_mode == "seq-mean-token-sum-norm" and config.norm_length is None:
        # Dr. GRPO's L is a constant (the trainer's: max_new_tokens); unset, it is the batch's width
        config = gppo.preset(name, kl_coef=kl, kl_estimator="k3" if kl else "k1", norm_length=T)
    leaf = log_pi.clone().requires_grad_(True)
    torch.manual_seed(0)  # clip-cov draws its detached tokens with torch.randperm
    reference_loss, reference_metrics = gppo.policy_loss(
        batch_from(log_mu, leaf, log_old, log_ref, ids, adv, mask), config
    )
    (reference_grad,) = torch.autograd.grad(reference_loss, leaf)

    holed_leaf = with_tool_spans(log_pi, junk_pi).requires_grad_(True)
    holed_mask = with_tool_spans(mask, torch.zeros(B, width))
    holed_adv = adv if not per_token_advantages else with_tool_spans(adv, torch.randn(B, width, generator=gen))
    holed = batch_from(
        with_tool_spans(log_mu, junk_mu),
        holed_leaf,
        with_tool_spans(log_old, junk_old),
        with_tool_spans(log_ref, junk_ref),
        with_tool_spans(ids, junk_ids),
        holed_adv,
        holed_mask,
    )
    torch.manual_seed(0)
    loss, metrics = gppo.policy_loss(holed, config)
    (grad,) = torch.autograd.grad(loss, holed_leaf)

    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    torch.testing.assert_close(grad[keep].view(B, T, V), reference_grad, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == reference_metrics.keys()
    for key, value in reference_metrics.items():
        assert math.isclose(metrics[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, metrics[key], value)
