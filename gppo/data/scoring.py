"""The verifier of each kind of problem: math answers through math-verify, code tests in the sandbox.

Training data (`gppo.trainer.data`) and benchmarks (`gppo.evaluation`) both score through `score`,
so a kind gets the same verifier in training and in evaluation."""

from __future__ import annotations

from collections.abc import Sequence

from gppo.rewards.code import CodeResult, CodeTest, Limits, score_code
from gppo.rewards.math import MathResult, score_math

SCORED_KINDS = ("math", "code")  # the kinds of `DataRecord` that have a verifier ("reward" has none)


def score(
    kind: str,
    completions: Sequence[str],
    answers: Sequence[str | None],
    tests: Sequence[Sequence[CodeTest] | None],
    math_timeout_s: float = 5.0,
    code_limits: Limits = Limits(),
) -> list[MathResult] | list[CodeResult]:
    """Score completions of problems of one `kind`, each against its own problem: math against
    `answers` (`score_math`), code against `tests` (`score_code`)."""
    if kind == "math":
        return score_math(completions, answers, timeout_s=math_timeout_s)
    if kind == "code":
        return score_code(completions, tests, limits=code_limits)
    raise ValueError(f"problems of kind {kind!r} have no verifier; the kinds with one are {list(SCORED_KINDS)}")
