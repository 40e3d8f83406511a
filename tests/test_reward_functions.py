"""User reward functions: loading from a file path or a module path (the working directory
importable), errors that name the file / module and the function, and failing or hanging functions
that stop the run with their text instead of silently scoring 0."""

import math
import threading
import time
import warnings

import pytest

from gppo.problem import Problem
from gppo.rewards.pipeline import RewardFunctionError, RewardPipeline, load_function
from tests import reward_fns

PROBLEMS = [Problem("1+1=", "2")] * 2
REWARD_FILE = """
def exclaims(prompts, completions, **kwargs):
    return [float(c.endswith("!")) for c in completions]


def length(prompts, completions, **kwargs):
    return [len(c) for c in completions]
"""


def pipeline(fn, **knobs) -> RewardPipeline:
    return RewardPipeline(None, [(getattr(fn, "__name__", "flaky"), fn)], **knobs)


def score(p: RewardPipeline) -> list[float]:
    return p(PROBLEMS, ["hi!", "hi"], [[1], [2]]).rewards


# ------------------------------------------------------------------------------ loading
@pytest.mark.parametrize(
    "spec", ["reward.py:exclaims", "./reward.py:exclaims", "ABSOLUTE/reward.py:exclaims", "sub/reward.py:exclaims"]
)
def test_a_reward_file_loads_by_relative_or_absolute_path(tmp_path, monkeypatch, spec):
    (tmp_path / "sub").mkdir()
    for folder in (tmp_path, tmp_path / "sub"):
        (folder / "reward.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    fn = load_function(spec.replace("ABSOLUTE", str(tmp_path)))
    assert fn(prompts=["p", "p"], completions=["yes!", "no"]) == [1.0, 0.0]
    assert pipeline(fn).__call__(PROBLEMS, ["a!", "b"], [[1], [2]]).rewards == [1.0, 0.0]


def test_two_functions_of_one_file_share_its_module(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    exclaims, length = load_function("reward.py:exclaims"), load_function("reward.py:length")
    assert exclaims.__module__ == length.__module__ and length(prompts=[], completions=["abc"]) == [3]


def test_a_module_in_the_working_directory_loads_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(REWARD_FILE)
    (tmp_path / "my_reward_pkg").mkdir()
    (tmp_path / "my_reward_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_reward_pkg" / "scores.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    import sys

    assert load_function("my_reward_mod:exclaims")(prompts=[], completions=["!"]) == [1.0]
    assert load_function("my_reward_pkg.scores:length")(prompts=[], completions=["ab"]) == [2]
    assert load_function("my_reward_pkg.scores.length")(prompts=[], completions=["a"]) == [1]  # dotted form
    assert str(tmp_path) not in sys.path  # only during the import
    for name in ("my_reward_mod", "my_reward_pkg", "my_reward_pkg.scores"):
        sys.modules.pop(name, None)


def test_loading_errors_name_the_file_or_module_the_function_and_what_exists(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"file 'reward.py' has no function 'exclaim' \(did you mean 'exclaims'\?\) "
        r"\(reward function 'reward.py:exclaim'\); its functions: exclaims, length",
    ):
        load_function("reward.py:exclaim")
    with pytest.raises(
        ValueError,
        match=r"reward function file 'rewards.py' does not exist \(reward function "
        r"'rewards.py:exclaims', looked in .*\) \(did you mean 'reward.py'\?\)",
    ):
        load_function("rewards.py:exclaims")
    with pytest.raises(
        ValueError,
        match=r"cannot import module 'rewardz' of reward function 'rewardz:fn': No module "
        r"named 'rewardz' \(looked in the working directory .* \(did you mean "
        r"'reward'\?\); give path/to/file.py:function",
    ):
        load_function("rewardz:fn")
    with pytest.raises(
        ValueError,
        match=r"module 'broken' of reward function 'broken:f' failed to import: No module "
        r"named 'no_such_dependency_xyz'",
    ):
        load_function("broken:f")
    with pytest.raises(ValueError, match=r"reward function file 'syntax.py' failed to import: SyntaxError"):
        load_function("syntax.py:f")
    with pytest.raises(
        ValueError,
        match=r"module 'tests.reward_fns' has no function 'raise' \(did you mean "
        r"'raises'\?\) .*its functions: .*length_bonus",
    ):
        load_function("tests.reward_fns:raise")
    with pytest.raises(ValueError, match="must be given as path/to/file.py:function or module:function"):
        load_function("reward")
    with pytest.raises(ValueError, match=r"'reward.py' names a file but no function: give reward.py:FUNCTION"):
        load_function("reward.py")
    import sys

    sys.modules.pop("broken", None)


# ------------------------------------------------------------------------------ failing functions
def test_a_function_that_always_raises_stops_after_max_failures_calls_in_a_row():
    p = pipeline(reward_fns.raises, max_failures=3)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="reward function raises: 2 of 2 samples"):
            assert score(p) == [0.0, 0.0]
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function raises \(defined in .*reward_fns.py\) failed on "
        r"3 calls in a row, the last with RuntimeError: this reward function "
        r"is broken; fix it .*--reward_fn_max_failures",
    ) as err:
        score(p)
    assert isinstance(err.value.__cause__, RuntimeError)  # GPPO_DEBUG=1 shows the function's traceback


def test_only_failures_in_a_row_count():
    flaky = reward_fns.Flaky(failing={0, 1, 3, 4, 6, 7, 8})
    p = pipeline(flaky, max_failures=3)
    with pytest.warns(RuntimeWarning):
        outcomes = [score(p) for _ in range(6)]  # fail, fail, ok, fail, fail, ok: never 3 in a row
    assert outcomes == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    with pytest.warns(RuntimeWarning), pytest.raises(RewardFunctionError, match="ConnectionError: call 8"):
        for _ in range(3):
            score(p)


def test_a_wrong_length_result_is_a_failing_call_and_zero_never_stops():
    p = pipeline(reward_fns.wrong_length, max_failures=2)
    with pytest.warns(RuntimeWarning):
        score(p)
    with pytest.raises(RewardFunctionError, match="ValueError: returned 1 values for 2 completions"):
        score(p)
    never = pipeline(reward_fns.raises, max_failures=0)
    with pytest.warns(RuntimeWarning):
        assert [score(never) for _ in range(5)] == [[0.0, 0.0]] * 5


class Scripted:
    """Gives its outcomes in turn, one per call: a list of values, or an exception to raise."""

    def __init__(self, *outcomes):
        self.outcomes = iter(outcomes)

    def __call__(self, prompts, completions, **kwargs):
        outcome = next(self.outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.mark.parametrize(
    "fn, first",
    [
        (reward_fns.raises, "the call raised RuntimeError: this reward function is broken"),
        (reward_fns.half_nan, "sample 1 gave nan"),
        (Scripted([None, "n/a"]), "sample 1 gave 'n/a' (ValueError: "),
        (Scripted([[1.0], 1e9]), "sample 0 gave [1.0] (TypeError: "),
    ],
    ids=["raises", "nan", "text", "list"],
)
def test_the_warning_shows_the_first_failure(fn, first):
    with pytest.warns(RuntimeWarning, match=r"samples gave no finite reward .*; they get 0\. The first: ") as caught:
        score(pipeline(fn, max_failures=0))
    assert first in str(caught[0].message), caught[0].message


@pytest.mark.parametrize(
    "values, last, cause",
    [
        (["n/a", "n/a"], "sample 0 gave 'n/a' (ValueError: ", ValueError),
        ([None, math.inf], "sample 1 gave inf", None),
        ([math.nan, math.inf], "sample 0 gave nan", None),
    ],
)
def test_a_function_failing_on_every_sample_stops_the_run_as_one_that_raises(values, last, cause):
    p = pipeline(Scripted(*[values] * 3), max_failures=3)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match=f"{sum(v is not None for v in values)} of 2 samples"):
            assert score(p) == [0.0, 0.0]
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function flaky failed on 3 calls in a row, the last with "
        r"no usable value from any of its 2 samples, the first: ",
    ) as err:
        score(p)
    assert last in str(err.value) and "--reward_fn_max_failures (0: never stop)" in str(err.value)
    assert type(err.value.__cause__) is cause or (cause is None and err.value.__cause__ is None)
    never = pipeline(Scripted(*[values] * 5), max_failures=0)
    with pytest.warns(RuntimeWarning):
        assert [score(never) for _ in range(5)] == [[0.0, 0.0]] * 5


def test_raising_calls_and_calls_without_a_usable_value_make_one_row_that_a_usable_value_ends():
    down = ConnectionError("the grading service is down")
    p = pipeline(
        Scripted(down, [None, None], [1.0, None], down, [math.nan, None], [0.5, 0.5], down, [None, None], down, down),
        max_failures=3,
    )
    with pytest.warns(RuntimeWarning):
        # usable values on calls 3 and 6 end the rows; a call of None alone (2, 8) neither ends nor extends one
        outcomes = [score(p) for _ in range(9)]
    assert outcomes == [[0.0, 0.0]] * 2 + [[1.0, 0.0]] + [[0.0, 0.0]] * 2 + [[0.5, 0.5]] + [[0.0, 0.0]] * 3
    with pytest.raises(
        RewardFunctionError,
        match="failed on 3 calls in a row, the last with ConnectionError: the grading service is down",
    ):
        score(p)


def test_none_is_a_reward_that_does_not_apply_as_in_trl():
    """TRL's convention: a function returns None where it does not apply (a code reward on a math
    prompt); that adds 0 and is no failure, however often. A sample no reward applies to warns."""
    code_only = Scripted(*[[None, 0.5]] * 4)
    mixed = RewardPipeline(None, [("code", code_only), ("math", Scripted(*[[1.0, None]] * 4))], max_failures=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [score(mixed) for _ in range(4)] == [[1.0, 0.5]] * 4
    alone = pipeline(Scripted(*[[None, None]] * 4), max_failures=3)
    for _ in range(4):
        with pytest.warns(RuntimeWarning, match="2 of 2 samples have no reward: every reward function returned None"):
            assert score(alone) == [0.0, 0.0]


def test_a_function_that_does_not_return_in_time_is_an_error_naming_it():
    p = pipeline(reward_fns.sleeps, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function sleeps \(defined in .*reward_fns.py\) did not "
        r"return within 0.3 s \(--reward_fn_timeout\) for 2 completions",
    ):
        score(p)
    assert time.monotonic() - start < 5


def test_the_timeout_works_outside_the_main_thread_and_zero_calls_in_place():
    errors = []

    def run():
        try:
            score(pipeline(reward_fns.sleeps, timeout_s=0.2))
        except RewardFunctionError as err:
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=10)
    assert len(errors) == 1
    callers = []

    def where(prompts, completions, **kwargs):
        callers.append(threading.current_thread())
        return [0.0] * len(completions)

    score(pipeline(where, timeout_s=0))
    score(pipeline(where, timeout_s=5))
    assert callers[0] is threading.main_thread() and callers[1] is not threading.main_thread()


def test_a_function_needing_the_main_thread_is_told_how():
    def alarm(prompts, completions, **kwargs):
        import signal

        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # raises outside the main thread
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="needs --reward_fn_timeout 0"):
        score(pipeline(alarm, max_failures=1))
    assert score(pipeline(alarm, max_failures=1, timeout_s=0)) == [0.0, 0.0]


@pytest.mark.parametrize("knob, value", [("max_failures", -1), ("timeout_s", -1.0), ("timeout_s", float("nan"))])
def test_bad_knobs_are_refused(knob, value):
    flag = {"max_failures": "reward_fn_max_failures", "timeout_s": "reward_fn_timeout"}[knob]
    with pytest.raises(ValueError, match=f"{flag} = .* must be a number >= 0"):
        pipeline(reward_fns.length_bonus, **{knob: value})
