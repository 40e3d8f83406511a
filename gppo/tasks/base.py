"""The task interface: problems with exact verifiers, for the embedded default and for tests."""

from __future__ import annotations

import random
from typing import Protocol

from gppo.problem import Problem


class Task(Protocol):
    """A family of synthetic problems with an exact verifier and an imperfect teacher.

    A task may carry `defaults`: `gppo train` settings it needs (e.g. {"max_new_tokens": 64}),
    taken where the run leaves them unset (`TrainConfig`)."""

    name: str

    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem."""
        ...

    def score(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1] of a completion (the generated text after the prompt, EOS removed)."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """A completion from the imperfect teacher used for the supervised warm start."""
        ...
