"""`Problem`: one verifiable problem, the unit that data, tasks, rewards and evaluation pass around.

A leaf module (it imports nothing from gppo), so that rewards and tasks can both use it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One verifiable problem. `answer` is the reference the verifier compares against."""

    prompt: str | list[dict]  # text, or chat messages (data files; see gppo.prompts)
    answer: str
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
