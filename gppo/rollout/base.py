"""The rollout engine interface shared by training (`gppo train`) and evaluation (`gppo eval`).

An engine turns prompts into sampled completions and records, for every generated token, the
behaviour policy's log-probability of the sampled token and, on request, mu's top-K ids and
log-probs, computed from the same (temperature-scaled) logits that were sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` means greedy decoding (and ignores `top_p`).

    `top_p < 1` samples from the nucleus S (the smallest set of most probable tokens whose mass
    reaches top_p) renormalised: mu_S(a) = mu(a) / mu(S) on S, 0 elsewhere. Every recorded
    log-prob is of mu_S (top-K entries outside S read -inf). `record_kept_ids` also returns S per
    token, so that the trainer scores pi on the same truncated, renormalised distribution
    (gppo.models.forward); without it a trainer that scores pi on the full vocabulary sees
    r = pi(S) < 1 at the first update.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    n: int = 1  # completions per prompt
    top_k_logprobs: int = 0  # record mu's top-K ids and log-probs per generated token (0: none)
    seed: int | None = None
    # one seed per completion in output order (instead of `seed`): each draws from its own random
    # stream, so that it samples the same tokens whatever the other rows do (resumed tool segments)
    row_seeds: tuple[int, ...] | None = None
    record_kept_ids: bool = False  # with top_p < 1: return the nucleus S of every generated token
    # stop a completion when it closes a ```python block (finish_reason "tool"; gppo.rollout.tools)
    stop_at_code_block: bool = False
    # called with (the completion's index in the output, its code, its tokens so far) as soon as it
    # stops at a block (HF engine), so that the tool runs while the other completions decode
    on_code_block: Callable[[int, str, int], None] | None = field(default=None, compare=False, repr=False)
    # Partial rollouts (gppo.trainer.async_rollouts): called before every forward (HF) or engine
    # step (vLLM) that gives tokens' logits, it returns the version of the weights that forward uses
    # (after loading newer ones, if any). On a change the engine recomputes the completions' KV cache
    # under the new weights, so that every recorded log-prob is exactly its version's; the versions
    # are recorded per token in Generation.versions.
    policy_version: Callable[[], int] | None = field(default=None, compare=False, repr=False)
    # Progress: called with (tokens generated since the last call, completions that ended since):
    # after each decoding step (HF engine) or each time a prompt's n completions end (vLLM).
    on_step: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)


def check_row_seeds(params: SamplingParams, prompts: int) -> None:
    """Refuse `row_seeds` that do not give each of the `params.n` completions of `prompts` prompts
    one seed."""
    if params.row_seeds is not None and len(params.row_seeds) != prompts * params.n:
        raise ValueError(f"row_seeds has {len(params.row_seeds)} seeds for {prompts * params.n} completions")


def groups_room(slots: int, running: int, n: int) -> int:
    """How many groups of `n` completions a stream may start with `running` of its `slots` taken:
    those that fit, and one when none runs (a group larger than the batch still starts)."""
    return max((slots - running) // n, 0 if running else 1)


@dataclass(frozen=True)
class GroupRequest:
    """A prompt whose `SamplingParams.n` completions join a running batch together (`stream`):
    `key` names the group, and each completion draws from its own seed in `row_seeds`."""

    key: object
    prompt_ids: list[int]
    row_seeds: tuple[int, ...]


@dataclass
class Generation:
    """One sampled completion of one prompt.

    `logprobs[t]` is log mu(completion_ids[t] | prefix) under the sampling temperature (and top_p);
    `topk_ids[t]` / `topk_logprobs[t]` are mu's K most probable tokens at step t (descending).
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    finish_reason: str = "stop"  # "stop" (EOS), "length" (hit max_new_tokens), "tool" (closed a code block)
    kept_ids: list[list[int]] | None = None  # top-p nucleus S at step t, by descending mu (record_kept_ids)
    tool_mask: list[int] | None = None  # 1 at the model's tokens, 0 at a tool's (gppo.rollout.tools)
    tool_calls: int = 0
    tool_failures: int = 0
    versions: list[int] | None = None  # per token: the weights version that sampled it (policy_version)


class RolloutEngine(Protocol):
    """Anything that can sample completions: `HFEngine` (CPU/GPU, transformers) or `VLLMEngine`."""

    max_top_k_logprobs: int  # the largest K it can record (vLLM caps it; HF has no cap)
    # True when mu comes from the engine's own copy of the weights and kernels (vLLM): the trainer
    # then recomputes pi_old on every batch, for the mismatch metrics.
    separate_weights: bool

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt (text, or token ids taken as they are), grouped
        by prompt in prompt order."""
        ...

    def stream(
        self,
        feed: Callable[[int], Sequence[GroupRequest]],
        params: SamplingParams,
        done: Callable[[object, list[Generation]], None],
    ) -> None:
        """Continuous batching: before each decoding step `feed(k)` may give up to k groups to
        start (k: what the free slots hold); `done(key, generations)` gets each group once its
        completions have all ended. Returns when none runs and `feed` gives none."""
        ...

    def update_weights(self, model) -> None:
        """Sample from `model`'s weights from now on (a no-op for an engine that samples from
        `model` itself)."""
        ...
