"""Pieces of the update step: group-preserving mini-batch order, weighted metric means, the weight
norm and the limits that tell a diverged update."""

from __future__ import annotations

from collections import defaultdict

import torch

# An update that multiplies the weight norm by more than this has exploded: AdamW moves each weight
# by about lr per step, so a healthy update changes ||theta|| by a small fraction (lr 1e-4 on weights
# of scale 0.02: < 1 %), while lr 1e6 multiplies it by ~1e7 at the first step.
WEIGHT_GROWTH_LIMIT = 10.0
# RL steps in a row whose every update had an exactly zero gradient although the advantages were
# not: the log-probs are saturated (blown-up weights) or every token is outside the trust region.
ZERO_GRADIENT_STEPS_LIMIT = 3


class MeanOf:
    """Weighted means of metric dicts (weights: tokens for per-token metrics)."""

    def __init__(self):
        self.sums, self.weights = defaultdict(float), defaultdict(float)

    def add(self, metrics: dict, weight: float = 1.0) -> None:
        for key, value in metrics.items():
            self.sums[key] += value * weight
            self.weights[key] += weight

    def result(self, prefix: str = "") -> dict:
        return {prefix + k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


@torch.no_grad()
def shuffled_groups(size: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A random order of the rollout's rows that keeps each group's rows together (rows
    g * group_size ... (g + 1) * group_size - 1 are the completions of prompt g), as verl's
    mini-batches do: a micro-batch then holds whole groups, whose prompt the forward runs once."""
    assert size % group_size == 0, f"a rollout of {size} rows is not made of groups of {group_size}"
    groups = torch.randperm(size // group_size, generator=generator)
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def total_norm(parameters) -> float:
    """||theta||_2 over all parameters."""
    return torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for p in parameters])).item()
