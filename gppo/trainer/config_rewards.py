"""`gppo train`'s reward and advantage options (a base of TrainConfig; TrainConfig checks them together)."""

from __future__ import annotations

from dataclasses import dataclass

from gppo.advantages import ADVANTAGE_ESTIMATORS
from gppo.options import option
from gppo.rewards.pipeline import MAX_FAILURES, TIMEOUT_S, compile_format_pattern

_opt = option


@dataclass
class RewardOptions:
    """How a run scores its completions and turns rewards into advantages."""

    # rewards and advantages
    reward_funcs: list[str] = _opt(
        [],
        "extra reward functions as path/to/file.py:function or module:function "
        "(the working directory is importable), called like TRL's (prompts=, "
        "completions=, completion_ids=, answer=, **columns; with --tools also tool_mask=, 0 at tool tokens)",
        "rewards and advantages",
        example=["my_rewards.py:length_bonus"],
    )
    reward_weights: list[float] = _opt(
        [],
        "weights of the verifier followed by each reward function (default all 1)",
        "rewards and advantages",
        example=[1.0, 0.5],
    )
    overlong_buffer: int = _opt(
        0,
        "DAPO soft overlong penalty: the last N tokens before max_new_tokens "
        "are penalised linearly down to -1 (0: off)",
        "rewards and advantages",
        ge=0,
    )
    format_pattern: str | None = _opt(
        None,
        "regular expression a well-formed completion matches (re.fullmatch on the stripped text of the model's "
        "tokens: tool outputs cut out)",
        "rewards and advantages",
        check=compile_format_pattern,
        example=r"\\d+",
    )
    format_reward: float = _opt(0.0, "reward added when format_pattern matches", "rewards and advantages")
    advantage: str = _opt(
        "grpo",
        "advantage estimator: grpo, dr_grpo, rloo, reinforce++",
        "rewards and advantages",
        choices=ADVANTAGE_ESTIMATORS,
    )
    dynamic_sampling: bool = _opt(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and refill with new prompts",
        "rewards and advantages",
    )
    max_resample_rounds: int = _opt(
        4, "dynamic sampling: extra rollout rounds per step at most", "rewards and advantages", ge=0
    )
    reward_fn_max_failures: int = _opt(
        MAX_FAILURES,
        "stop the run when a reward function fails on this many "
        "calls in a row: it raises, or returns no usable value (NaN, not a number, too "
        "large; None means 'does not apply', as in TRL, and is no failure); each failing "
        "call gives 0; 0: never stop",
        "rewards and advantages",
        ge=0,
    )
    reward_fn_timeout: float = _opt(
        TIMEOUT_S,
        "seconds a reward function call may take before the run stops "
        "(calls run in a worker thread; 0: no limit, called in the calling thread)",
        "rewards and advantages",
        ge=0,
    )
