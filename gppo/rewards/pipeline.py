"""From completions to scalar rewards: the verifier, user reward functions, shaping terms.

reward = w_0 * verifier + sum_j w_j * user_fn_j + format bonus + DAPO soft overlong penalty
(data without answers has no verifier: then the weights are those of the user functions alone).

User functions follow TRL's convention: `fn(prompts=[...], completions=[...], completion_ids=[...],
answer=[...], **columns) -> list[float | None]`, given as a dotted path `module:function`; `prompts`
are the data's prompts (text or chat messages) before the prompt template, `answer` the reference
answers, and `columns` every other data column (from `problem.metadata["columns"]`; None for a
problem without that column). A function that raises, or returns NaN/None/a value beyond
+-MAX_REWARD/a wrong-length list, gives 0 for the affected samples and a counted warning; the run
goes on. Weights and the format reward must be finite numbers, and a total beyond +-MAX_REWARD
(weights that overflow) is an error naming the sample and its components: group statistics of
such rewards are not finite in float32.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

from gppo.tasks.base import Problem

MAX_REWARD = 1e6  # |reward| bound: squares of rewards stay far inside float32 in the advantage std


def compile_format_pattern(pattern: str) -> re.Pattern:
    """The compiled format regular expression (DOTALL); a ValueError says what is wrong with it."""
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"is not a valid regular expression ({err}); escape literal characters such as "
                         "( [ . * + ? with a backslash, e.g. '\\(\\d+\\)'") from None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_function(path: str) -> Callable:
    """Import `module:function` (or `module.function`)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function {path!r} must be given as module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of reward function {path!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no function {attr!r} (reward function {path!r})")
    return fn


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linear down to -1 at max."""
    if buffer <= 0 or length <= max_length - buffer:
        return 0.0
    return max(-1.0, (max_length - buffer - length) / buffer)


def check_reward_weights(weights: Sequence[float], functions: int, verifier: bool | None = True) -> None:
    """Weights of the verifier (when there is one) then each of `functions` reward functions: none
    (all 1), or one finite number within +-MAX_REWARD per reward. `verifier=None`: not known yet
    (data files: their answer column decides), so both counts are accepted."""
    n = int(bool(verifier)) + functions
    if weights and len(weights) != n and not (verifier is None and len(weights) == n + 1):
        if not verifier:
            rewards = f"{n} rewards (one per reward function: the data has no answers, so there is no verifier)"
        else:
            rewards = "1 reward (the verifier)" if n == 1 else f"{n} rewards (the verifier, then each reward function)"
        raise ValueError(f"reward_weights has {len(weights)} values but there {'is' if n == 1 else 'are'} {rewards}: "
                         f"give one weight per reward, e.g. --reward_weights {' '.join(['1.0'] * n)}")
    for i, w in enumerate(weights):
        if not (_is_number(w) and abs(w) <= MAX_REWARD):
            raise ValueError(f"reward_weights[{i}] = {w!r} is not a number within +-{MAX_REWARD:g}; "
                             "give e.g. --reward_weights 1.0 0.5")


@dataclass
class RewardResult:
    rewards: list[float]
    accuracy: list[float]  # the verifier alone (without one: the weighted user functions)
    components: dict[str, list[float]] = field(default_factory=dict)
    warnings: int = 0


@dataclass
class RewardPipeline:
    """Scores completions of `Problem`s. `verifier(problems, completions) -> list[float]`, or None."""

    verifier: Callable[[Sequence[Problem], Sequence[str]], list[float]] | None
    user_functions: list[tuple[str, Callable]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    format_pattern: str | None = None
    format_reward: float = 0.0
    max_length: int = 0
    overlong_buffer: int = 0

    def __post_init__(self):
        if self.verifier is None and not self.user_functions:
            raise ValueError("nothing scores the completions: the data has no answer column, so give reward "
                             "functions (reward_funcs) or map an answer column (answer_field)")
        check_reward_weights(self.weights, len(self.user_functions), verifier=self.verifier is not None)
        self.weights = list(self.weights) or [1.0] * ((self.verifier is not None) + len(self.user_functions))
        if not (_is_number(self.format_reward) and abs(self.format_reward) <= MAX_REWARD):
            raise ValueError(f"format_reward = {self.format_reward!r} is not a number within +-{MAX_REWARD:g}; "
                             "give e.g. --format_reward 0.1")
        try:
            self._format = compile_format_pattern(self.format_pattern) if self.format_pattern else None
        except ValueError as err:
            raise ValueError(f"format_pattern {self.format_pattern!r} {err}") from None

    def __call__(self, problems: Sequence[Problem], completions: Sequence[str],
                 completion_ids: Sequence[Sequence[int]]) -> RewardResult:
        n = len(completions)
        user_weights = self.weights[1:] if self.verifier is not None else self.weights
        if self.verifier is not None:
            accuracy = [float(v) for v in self.verifier(problems, completions)]
            totals = [self.weights[0] * a for a in accuracy]
            result = RewardResult(totals, accuracy, {"verifier": accuracy})
        else:
            totals = [0.0] * n
            result = RewardResult(totals, [], {})  # accuracy: the user functions' total, set below
        data_columns = [p.metadata.get("columns") or {} for p in problems]
        names = dict.fromkeys(k for c in data_columns for k in c)
        columns = {name: [c.get(name) for c in data_columns] for name in names}
        columns.update({"prompts": [p.prompt for p in problems], "completions": list(completions),
                        "completion_ids": [list(c) for c in completion_ids], "answer": [p.answer for p in problems]})
        for (name, fn), weight in zip(self.user_functions, user_weights):
            values, bad = self._call_user(fn, columns, n)
            result.warnings += bad
            if bad:
                warnings.warn(f"reward function {name}: {bad} of {n} samples gave no finite reward within "
                              f"+-{MAX_REWARD:g} (raised, NaN, None or too large); they get 0", RuntimeWarning,
                              stacklevel=2)
            result.components[name] = values
            totals = [t + weight * v for t, v in zip(totals, values)]
        if self.verifier is None:
            result.accuracy = totals
        if self._format is not None:
            bonus = [self.format_reward * bool(self._format.fullmatch(c.strip())) for c in completions]
            result.components["format"] = bonus
            totals = [t + b for t, b in zip(totals, bonus)]
        if self.overlong_buffer > 0:
            penalty = [overlong_penalty(len(ids), self.max_length, self.overlong_buffer) for ids in completion_ids]
            result.components["overlong"] = penalty
            totals = [t + p for t, p in zip(totals, penalty)]
        bad = next((i for i, t in enumerate(totals) if not abs(t) <= MAX_REWARD), None)
        if bad is not None:
            parts = ", ".join(f"{name} {values[bad]:g}" for name, values in result.components.items())
            raise ValueError(f"the reward of sample {bad} is {totals[bad]:g} ({parts}; weights {self.weights}), "
                             f"beyond +-{MAX_REWARD:g}: lower reward_weights / format_reward")
        result.rewards = totals
        return result

    @staticmethod
    def _call_user(fn: Callable, columns: dict, n: int) -> tuple[list[float], int]:
        try:
            values = fn(**columns)
            values = list(values)
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except Exception:  # noqa: BLE001 - a user function must never stop the run
            return [0.0] * n, n
        clean, bad = [], 0
        for v in values:
            try:
                v = float(v)
            except (TypeError, ValueError):
                v = math.nan
            if math.isfinite(v) and abs(v) <= MAX_REWARD:
                clean.append(v)
            else:
                clean.append(0.0)
                bad += 1
        return clean, bad
