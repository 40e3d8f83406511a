"""User reward functions for the trainer tests (TRL calling convention)."""

import math


def length_bonus(prompts, completions, **kwargs):
    return [0.01 * len(c) for c in completions]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("this reward function is broken")


def half_nan(prompts, completions, **kwargs):
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def matches_target(prompts, completions, target, **kwargs):
    """1 when the completion starts with the data's `target` column."""
    return [float(c.strip().startswith(t)) for c, t in zip(completions, target)]
