"""Group-relative advantages from rewards [G, n] (G prompts, n completions each); docs/design.md section 6.

grpo:        (R - mean_g) / (std_g + eps)                    (Shao et al. 2024)
dr_grpo:     R - mean_g                                       (Liu et al. 2025, "Dr. GRPO")
rloo:        n / (n - 1) (R - mean_g) = R - mean of the others (Ahmadian et al. 2024)
reinforce++: R - mean_g, then whitened over the whole batch    (Hu 2025, REINFORCE++-baseline)
std_g is the unbiased sample standard deviation of the group.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce++")


def group_advantages(rewards: torch.Tensor, estimator: str, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [G, n] of rewards [G, n]."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {list(ADVANTAGE_ESTIMATORS)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if n < 2:
        raise ValueError("group-relative advantages need group_size >= 2")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        return centred / (rewards.std(dim=1, keepdim=True) + eps)
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        return centred * n / (n - 1)
    return (centred - centred.mean()) / (centred.std() + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [G]: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
