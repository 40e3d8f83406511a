"""From completions to scalar rewards: the verifier, user reward functions, shaping terms.

reward = w_0 * verifier + sum_j w_j * user_fn_j + format bonus + DAPO soft overlong penalty
(data without answers has no verifier: then the weights are those of the user functions alone).

User functions follow TRL's convention: `fn(prompts=[...], completions=[...], completion_ids=[...],
answer=[...], **columns) -> list[float | None]`, given as `path/to/file.py:function` (a file, as
verl takes it) or `module:function` (a module path, as TRL takes it, importable from the working
directory too): see `load_function`. `prompts` are the data's prompts (text or chat messages)
before the prompt template, `answer` the reference answers, and `columns` every other data column
(from `problem.metadata["columns"]`; None for a problem without that column).

Tool tokens (`--tools`: a tool's output spliced into the completion, `Generation.tool_mask` 0) are
neither the model's answer nor its length. The verifier and the format pattern read `model_text`,
the completion with its tool spans cut out, so that a tool output imitating an answer scores
nothing; the overlong penalty counts `model_tokens`. User functions get the whole completion, as
TRL gives it (`completions`, `completion_ids`, tool outputs included), and with tool tokens also
`tool_mask` (1 at the model's tokens, 0 at a tool's, per completion).

None is TRL's "this function does not apply to this sample" (e.g. a code reward on a math
prompt): it adds 0 to that sample's reward (TRL's nansum over functions) and is no failure; a
sample that no reward applies to (no verifier, every function None) gets 0 and a warning.
Failures: a value that is NaN/beyond +-MAX_REWARD, or that float() cannot convert, gives 0
for that sample and a counted warning naming the first failure (the sample, its value, the
exception). A failing call, one that raises (or returns no list of one value per completion) or
whose values are all unusable or None (at least one unusable), gives 0 for every sample and that
warning; `max_failures` failing calls in a row stop the run with a `RewardFunctionError` carrying
the last one's text (0: never stop); a call with one usable value ends the row, a call of None
alone neither ends nor extends it. A call that does not return within `timeout_s`
seconds is a `RewardFunctionError` at once. The timeout needs no signal (signal.alarm fails
outside the main thread, and rollouts may run in a background thread): the call runs in a daemon
worker thread and the caller stops waiting at the deadline. A hung thread cannot be killed; it is
left running until the process ends (the run stops anyway). Threads rather than processes because
reward functions often hold state (a loaded model, a cache) and need not be picklable. The price:
a function that must run in the main thread (signal.alarm, as math-verify's default timeouts use)
needs `timeout_s=0` (called in the caller's thread, no limit).

Weights and the format reward must be finite numbers, and a total beyond +-MAX_REWARD (weights that
overflow) is an error naming the sample and its components: group statistics of such rewards are
not finite in float32.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import math
import os
import re
import reprlib
import sys
import threading
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gppo.core import closest
from gppo.problem import Problem

MAX_REWARD = 1e6  # |reward| bound: squares of rewards stay far inside float32 in the advantage std
MAX_FAILURES = 3  # default: failing calls in a row of one reward function before the run stops
TIMEOUT_S = 60.0  # default: seconds one call of a reward function may take


def compile_format_pattern(pattern: str) -> re.Pattern:
    """The compiled format regular expression (DOTALL); a ValueError says what is wrong with it."""
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(
            f"is not a valid regular expression ({err}); escape literal characters such as "
            "( [ . * + ? with a backslash, e.g. '\\(\\d+\\)'"
        ) from None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RewardFunctionError(ValueError):
    """A user reward function failed `max_failures` calls in a row, or did not return in time."""


def load_function(spec: str) -> Callable:
    """The function of `file.py:function` (a path, relative to the working directory or absolute)
    or `module:function` / `module.function` (imported with the working directory on the import
    path, as `python -m` would have it). Errors name the file or module and the function, and list
    what exists."""
    where, sep, attr = spec.rpartition(":")
    if not sep and spec.endswith(".py"):
        raise ValueError(f"reward function {spec!r} names a file but no function: give {spec}:FUNCTION")
    if not sep:
        where, _, attr = spec.rpartition(".")
    if not where or not attr:
        raise ValueError(f"reward function {spec!r} must be given as path/to/file.py:function or module:function")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module, origin = _import_file(Path(where), spec), f"file {where!r}"
    else:
        module, origin = _import_module(where, spec), f"module {where!r}"
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        listed = f"; its functions: {', '.join(names)}" if names else "; it defines no function"
        raise ValueError(f"{origin} has no function {attr!r}{closest(attr, names)} (reward function {spec!r}){listed}")
    return fn


def _import_file(path: Path, spec: str):
    """Import a .py file as a module of its own (registered in sys.modules, so pickling works)."""
    if not path.is_file():
        nearby = [p.name for p in (path.parent if path.parent.is_dir() else Path()).glob("*.py")]
        raise ValueError(
            f"reward function file {str(path)!r} does not exist (reward function {spec!r}, looked in "
            f"{path.resolve().parent}){closest(path.name, nearby)}; give path/to/file.py:function"
        )
    name = f"gppo_reward_file_{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    if name in sys.modules:  # a second function of the same file
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file: any error is reported in words
        del sys.modules[name]
        raise ValueError(f"reward function file {str(path)!r} failed to import: {type(err).__name__}: {err}") from err
    return module


def _import_module(name: str, spec: str):
    """Import `name` with the working directory first on the import path for the import."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise ValueError(f"module {name!r} of reward function {spec!r} failed to import: {err}") from err
        nearby = [p.stem for p in Path(cwd).glob("*.py")]
        raise ValueError(
            f"cannot import module {name!r} of reward function {spec!r}: {err} (looked in the working "
            f"directory {cwd} and the installed packages){closest(name, nearby)}; give "
            "path/to/file.py:function or package.module:function"
        ) from None
    except Exception as err:  # noqa: BLE001 - the user's module: any error is reported in words
        raise ValueError(
            f"module {name!r} of reward function {spec!r} failed to import: {type(err).__name__}: {err}"
        ) from err
    finally:
        if added:
            sys.path.remove(cwd)


def describe_function(name: str, fn: Callable) -> str:
    """'NAME (defined in FILE)' for error messages."""
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    return f"{name} (defined in {source})" if source else name


def model_tokens(completion_ids: Sequence[int], tool_mask: Sequence[int] | None) -> int:
    """A completion's length: the tokens the model sampled (tool tokens, mask 0, are none of it)."""
    return len(completion_ids) if tool_mask is None else sum(tool_mask)


def model_text(text: str, completion_ids: Sequence[int], tool_mask: Sequence[int] | None, tokenizer=None) -> str:
    """The text of the model's own tokens: the completion `text` with its tool spans cut out, each run
    of model tokens decoded as the completion was (special tokens skipped), joined. `tokenizer` is
    needed only where `tool_mask` marks tool tokens."""
    if tool_mask is None or all(tool_mask):
        return text
    if tokenizer is None:
        raise ValueError(
            "tool_mask marks tool tokens, whose text is not the model's: give the tokenizer that decodes "
            "the model's own tokens (tokenizer=...)"
        )
    runs = itertools.groupby(zip(completion_ids, tool_mask), key=lambda pair: pair[1])
    return "".join(tokenizer.decode([t for t, _ in run], skip_special_tokens=True) for mine, run in runs if mine)


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
        raise ValueError(
            f"reward_weights has {len(weights)} values but there {'is' if n == 1 else 'are'} {rewards}: "
            f"give one weight per reward, e.g. --reward_weights {' '.join(['1.0'] * n)}"
        )
    for i, w in enumerate(weights):
        if not (_is_number(w) and abs(w) <= MAX_REWARD):
            raise ValueError(
                f"reward_weights[{i}] = {w!r} is not a number within +-{MAX_REWARD:g}; "
                "give e.g. --reward_weights 1.0 0.5"
            )


@dataclass
class RewardResult:
    rewards: list[float]
    accuracy: list[float]  # the verifier alone (without one: the weighted user functions)
    components: dict[str, list[float]] = field(default_factory=dict)
    warnings: int = 0


@dataclass
class RewardPipeline:
    """Scores completions of `Problem`s. `verifier(problems, texts) -> list[float]` (the texts of the
    model's tokens: `model_text`), or None."""

    verifier: Callable[[Sequence[Problem], Sequence[str]], list[float]] | None
    user_functions: list[tuple[str, Callable]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    format_pattern: str | None = None
    format_reward: float = 0.0
    max_length: int = 0
    overlong_buffer: int = 0
    max_failures: int = MAX_FAILURES  # failing calls in a row before the run stops (0: never)
    timeout_s: float = TIMEOUT_S  # seconds a call may take (0: no limit, called in the caller's thread)

    def __post_init__(self):
        if self.verifier is None and not self.user_functions:
            raise ValueError(
                "nothing scores the completions: the data has no answer column, so give reward "
                "functions (reward_funcs) or map an answer column (answer_field)"
            )
        check_reward_weights(self.weights, len(self.user_functions), verifier=self.verifier is not None)
        self.weights = list(self.weights) or [1.0] * ((self.verifier is not None) + len(self.user_functions))
        if not (_is_number(self.format_reward) and abs(self.format_reward) <= MAX_REWARD):
            raise ValueError(
                f"format_reward = {self.format_reward!r} is not a number within +-{MAX_REWARD:g}; "
                "give e.g. --format_reward 0.1"
            )
        try:
            self._format = compile_format_pattern(self.format_pattern) if self.format_pattern else None
        except ValueError as err:
            raise ValueError(f"format_pattern {self.format_pattern!r} {err}") from None
        for knob, value in (("reward_fn_max_failures", self.max_failures), ("reward_fn_timeout", self.timeout_s)):
            if not (_is_number(value) and value >= 0):
                raise ValueError(f"{knob} = {value!r} must be a number >= 0; give e.g. --{knob} 3")
        self._failures = {name: 0 for name, _ in self.user_functions}  # failing calls in a row

    def __call__(
        self,
        problems: Sequence[Problem],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        tool_mask: Sequence[Sequence[int] | None] | None = None,
        tokenizer=None,
    ) -> RewardResult:
        """Score each completion. `tool_mask` (per completion; None: no tool tokens) marks the model's
        tokens; `tokenizer` decodes them where a tool's tokens are cut out (module docstring)."""
        n = len(completions)
        masks = list(tool_mask) if tool_mask is not None else [None] * n
        own = [model_text(c, ids, m, tokenizer) for c, ids, m in zip(completions, completion_ids, masks)]
        user_weights = self.weights[1:] if self.verifier is not None else self.weights
        if self.verifier is not None:
            accuracy = [float(v) for v in self.verifier(problems, own)]
            totals = [self.weights[0] * a for a in accuracy]
            result = RewardResult(totals, accuracy, {"verifier": accuracy})
        else:
            totals = [0.0] * n
            result = RewardResult(totals, [], {})  # accuracy: the user functions' total, set below
        data_columns = [p.metadata.get("columns") or {} for p in problems]
        names = dict.fromkeys(k for c in data_columns for k in c)
        columns = {name: [c.get(name) for c in data_columns] for name in names}
        columns.update(
            {
                "prompts": [p.prompt for p in problems],
                "completions": list(completions),
                "completion_ids": [list(c) for c in completion_ids],
                "answer": [p.answer for p in problems],
            }
        )
        if any(m is not None for m in masks):
            columns["tool_mask"] = [None if m is None else list(m) for m in masks]
        applies = [self.verifier is not None] * n  # some reward applies to sample i
        for (name, fn), weight in zip(self.user_functions, user_weights):
            values, bad, first, applied = self._call_user(name, fn, columns, n)
            result.warnings += bad
            if bad:
                warnings.warn(
                    f"reward function {name}: {bad} of {n} samples gave no finite reward within "
                    f"+-{MAX_REWARD:g} (raised, NaN, not a number or too large); they get 0. The first: "
                    f"{first}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            result.components[name] = values
            totals = [t + weight * v for t, v in zip(totals, values)]
            applies = [a or b for a, b in zip(applies, applied)]
        if self.verifier is None:
            result.accuracy = totals
        if not all(applies):
            warnings.warn(
                f"{applies.count(False)} of {n} samples have no reward: every reward function returned "
                f"None (does not apply) for them, the first sample {applies.index(False)}; they get 0. "
                "Give every sample at least one reward that applies",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._format is not None:
            bonus = [self.format_reward * bool(self._format.fullmatch(c.strip())) for c in own]
            result.components["format"] = bonus
            totals = [t + b for t, b in zip(totals, bonus)]
        if self.overlong_buffer > 0:
            penalty = [
                overlong_penalty(model_tokens(ids, m), self.max_length, self.overlong_buffer)
                for ids, m in zip(completion_ids, masks)
            ]
            result.components["overlong"] = penalty
            totals = [t + p for t, p in zip(totals, penalty)]
        bad = next((i for i, t in enumerate(totals) if not abs(t) <= MAX_REWARD), None)
        if bad is not None:
            parts = ", ".join(f"{name} {values[bad]:g}" for name, values in result.components.items())
            raise ValueError(
                f"the reward of sample {bad} is {totals[bad]:g} ({parts}; weights {self.weights}), "
                f"beyond +-{MAX_REWARD:g}: lower reward_weights / format_reward"
            )
        result.rewards = totals
        return result

    def _call_user(self, name: str, fn: Callable, columns: dict, n: int) -> tuple[list[float], int, str, list[bool]]:
        """The function's values (0 where unusable or None), how many samples were unusable, the first
        failure in words, and where it applied (not None); raises RewardFunctionError after
        max_failures failing calls in a row (module docstring) or at the timeout."""
        clean, bad, first, cause, applied = [], 0, "", None, [True] * n
        try:
            values = list(self._call_with_timeout(name, fn, columns))
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except RewardFunctionError:
            raise
        except Exception as err:  # noqa: BLE001 - a few failing calls must not stop the run
            clean, bad, cause = [0.0] * n, n, err
            last = f"{type(err).__name__}: {err}"
            first = f"the call raised {last}"
        else:
            for i, value in enumerate(values):
                if value is None:  # does not apply to this sample
                    clean.append(0.0)
                    applied[i] = False
                    continue
                error = None
                try:
                    v = float(value)
                except Exception as err:  # noqa: BLE001 - the user's value: any error is reported in words
                    v, error = math.nan, err
                if math.isfinite(v) and abs(v) <= MAX_REWARD:
                    clean.append(v)
                    continue
                clean.append(0.0)
                bad += 1
                if not first:
                    first = f"sample {i} gave {reprlib.repr(value)}"
                    if error is not None:
                        first, cause = f"{first} ({type(error).__name__}: {error})", error
            last = f"no usable value from any of its {n} samples, the first: {first}"
        usable = n - bad - applied.count(False)
        if usable or not n:
            self._failures[name] = 0
        if usable or not bad:
            return clean, bad, first, applied
        self._failures[name] += 1
        if self.max_failures and self._failures[name] >= self.max_failures:
            hint = ""
            if "signal" in last or "thread" in last:
                hint = (
                    " (reward functions run in a worker thread so that --reward_fn_timeout can stop "
                    "waiting; one that needs the main thread, e.g. for signal.alarm, needs "
                    "--reward_fn_timeout 0)"
                )
            raise RewardFunctionError(
                f"reward function {describe_function(name, fn)} failed on {self._failures[name]} calls in a "
                f"row, the last with {last}{hint}; fix it (GPPO_DEBUG=1 shows its traceback), or raise "
                "--reward_fn_max_failures (0: never stop)"
            ) from cause
        return clean, bad, first, applied

    def _call_with_timeout(self, name: str, fn: Callable, columns: dict):
        """fn(**columns), in a daemon thread waited on for timeout_s seconds (0: in this thread)."""
        if not self.timeout_s:
            return fn(**columns)
        outcome: dict = {}

        def call():
            try:
                outcome["value"] = fn(**columns)
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                outcome["error"] = err

        worker = threading.Thread(target=call, name=f"gppo-reward-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise RewardFunctionError(
                f"reward function {describe_function(name, fn)} did not return within {self.timeout_s:g} s "
                f"(--reward_fn_timeout) for {len(columns['completions'])} completions; make it faster, or raise "
                "--reward_fn_timeout (0: no limit)"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
