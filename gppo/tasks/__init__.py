"""Task registry: `get_task("addition")`, `get_task("countdown", counts=(3,))`."""

from __future__ import annotations

import random

from gppo.core import closest
from gppo.problem import Problem
from gppo.tasks.arithmetic import AdditionTask
from gppo.tasks.base import Task
from gppo.tasks.countdown import CountdownTask
from gppo.tasks.multiplication import MultiplicationTask
from gppo.tasks.word_problems import WordProblemTask

TASKS = {
    "addition": AdditionTask,
    "countdown": CountdownTask,
    "multiplication": MultiplicationTask,
    "word-problems": WordProblemTask,
}

HELDOUT_SEED = 20_250_001  # default seed of the fixed evaluation set (training draws use small seeds)


def get_task(name: str, **kwargs) -> Task:
    """Build the task registered under `name`, passing `kwargs` to its constructor."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}{closest(name, TASKS)}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


def heldout_problems(task: Task, n: int, seed: int = HELDOUT_SEED) -> list[Problem]:
    """A fixed, seeded list of `n` problems for evaluation (same seed, same list)."""
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


__all__ = [
    "TASKS",
    "AdditionTask",
    "CountdownTask",
    "MultiplicationTask",
    "Problem",
    "Task",
    "WordProblemTask",
    "get_task",
    "heldout_problems",
]
