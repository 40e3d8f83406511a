"""Where problems come from (a built-in task or a data file) and how completions are verified.

A source hands out `Problem`s in a seeded order and can save / restore its position, so that a
resumed run sees exactly the problems an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gppo.data.loaders import DataRecord, load_training_data
from gppo.data.scoring import SCORED_KINDS, score
from gppo.models.loading import check_positions
from gppo.problem import Problem
from gppo.tasks import get_task, heldout_problems
from gppo.tasks.base import Task

SEED_STRIDE = 1_000_003  # a prime above any step count, so that (seed, index) pairs get distinct seeds


def derived_seed(seed: int, index: int) -> int:
    """The seed of draw `index` of a run seeded `seed`: the data order of an epoch, the sampling and
    shuffling of a step, the evaluations (a fixed index)."""
    return seed * SEED_STRIDE + index


class TaskSource:
    """An endless stream of freshly drawn task problems."""

    def __init__(self, task: Task, seed: int):
        self.task, self.rng = task, random.Random(seed)

    def take(self, n: int) -> list[Problem]:
        return [self.task.sample(self.rng) for _ in range(n)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])


class DatasetSource:
    """Records in a fresh seeded permutation every epoch."""

    def __init__(self, problems: list[Problem], seed: int):
        if not problems:
            raise ValueError("the training data holds no usable problem")
        self.problems, self.seed, self.epoch, self.cursor = problems, seed, 0, 0
        self.order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(derived_seed(self.seed, self.epoch)).shuffle(order)
        return order

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if self.cursor == len(self.order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._permutation()
            out.append(self.problems[self.order[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._permutation()


def record_to_problem(record: DataRecord) -> Problem:
    """A `Problem` whose metadata holds the record's kind, tests, id, metadata and, under
    "columns", the data columns that reach reward functions."""
    return Problem(
        record.prompt,
        record.answer or "",
        {"kind": record.kind, "tests": record.tests, "id": record.id, **record.metadata, "columns": record.columns},
    )


def record_verifier(problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
    """Math answers through math-verify, code through the sandbox; in batches of each kind."""
    scores = [0.0] * len(problems)
    for kind in SCORED_KINDS:
        idx = [i for i, p in enumerate(problems) if p.metadata.get("kind") == kind]
        if not idx:
            continue
        results = score(
            kind,
            [completions[i] for i in idx],
            [problems[i].answer for i in idx],
            [problems[i].metadata["tests"] for i in idx],
        )
        for i, result in zip(idx, results):
            scores[i] = float(result.reward)
    return scores


@dataclass
class ProblemSet:
    """What the trainer needs from the data: a training source, held-out problems, a verifier
    (None for data without answers, scored by reward functions only)."""

    train: TaskSource | DatasetSource
    heldout: list[Problem]
    verifier: Callable[[Sequence[Problem], Sequence[str]], list[float]] | None
    name: str


@dataclass(frozen=True)
class DataOptions:
    """Where training data comes from and how its columns map (see `gppo.data.loaders`)."""

    prompt_field: str | None = None
    answer_field: str | None = None
    from_hub: bool = False
    config: str | None = None
    split: str = "train"
    eval_split: str = "test"


def _load_records(source: str, options: DataOptions, split: str, need_answer: bool) -> list[Problem]:
    result = load_training_data(
        source,
        prompt_field=options.prompt_field,
        answer_field=options.answer_field,
        need_answer=need_answer,
        from_hub=options.from_hub,
        split=split,
        config=options.config,
    )
    if result.errors:
        shown = "; ".join(str(e) for e in result.errors[:3])
        print(f"warning: {len(result.errors)} rows of {source} were skipped: {shown}")
    return [record_to_problem(r) for r in result.records]


def build_problem_set(
    task: str,
    data: str | None,
    eval_data: str | None,
    eval_size: int,
    seed: int,
    options: DataOptions = DataOptions(),
    need_answer: bool = True,
) -> ProblemSet:
    """The built-in `task`, or the data `data` (its first eval_size records held out unless
    `eval_data` is given). `need_answer=False` (reward functions are given) accepts data without an
    answer column; such data gets no verifier."""
    if data is None:
        t = get_task(task)
        return ProblemSet(
            TaskSource(t, seed),
            heldout_problems(t, eval_size),
            lambda problems, completions: [t.score(p, c) for p, c in zip(problems, completions)],
            task,
        )
    problems = _load_records(data, options, options.split, need_answer)
    if eval_data is not None:
        heldout = _load_records(eval_data, options, options.eval_split, need_answer)[:eval_size]
    else:
        if len(problems) <= eval_size:
            raise ValueError(
                f"{data} has {len(problems)} problems, not more than eval_size={eval_size}: "
                "lower --eval_size or give --eval_data"
            )
        heldout, problems = problems[:eval_size], problems[eval_size:]
    verified = any(p.metadata["kind"] != "reward" for p in problems + heldout)
    return ProblemSet(DatasetSource(problems, seed), heldout, record_verifier if verified else None, data)


def check_prompt_lengths(problems: ProblemSet, prompts, tokenizer, model_config, max_new_tokens: int) -> None:
    """Render and tokenize every prompt of the data (the held-out ones and a built-in task's
    sample) before anything trains: a chat template that fails, or a prompt that with
    max_new_tokens would run past the model's positions, is an error now, not mid-run."""
    train = getattr(problems.train, "problems", [])  # a built-in task's are short and alike
    for where, chosen in (
        ("--data problem" if train else "training problem", train),
        ("held-out problem", problems.heldout),
    ):
        texts = [prompts(p.prompt) for p in chosen]
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []
        check_positions(model_config, lengths, max_new_tokens, where)
