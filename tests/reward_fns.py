"""User reward functions for the trainer tests (TRL calling convention)."""

import math


def length_bonus(prompts, completions, **kwargs):
    return [0.01 * len(c) for c in completions]


def digit_share(prompts, completions, **kwargs):
    """The share of digits in each completion: varies between a group's completions even when they
    all run to the length limit (length_bonus does not then)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("this reward function is broken")


def half_nan(prompts, completions, **kwargs):
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def matches_target(prompts, completions, target, **kwargs):
    """1 when the completion starts with the data's `target` column."""
    return [float(c.strip().startswith(t)) for c, t in zip(completions, target)]


def sleeps(prompts, completions, **kwargs):
    """Returns after 5 s: too late for the tests' timeouts of under a second."""
    import time

    time.sleep(5)
    return [0.0] * len(completions)


class Flaky:
    """Raises on the calls whose index (from 0) is in `failing`, else gives 1 per completion."""

    def __init__(self, failing):
        self.failing, self.calls = set(failing), 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.calls - 1 in self.failing:
            raise ConnectionError(f"call {self.calls - 1}: the grading service is down")
        return [1.0] * len(completions)


def kills_its_process(prompts, completions, **kwargs):
    """SIGKILL to the process calling it, as the kernel's out-of-memory killer would send."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


class VariesOnce:
    """Completion lengths as rewards on the first call (a gradient), then 0 for every completion."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        return [0.01 * len(c) for c in completions] if self.calls == 1 else [0.0] * len(completions)


varies_once = VariesOnce()
