"""The rollout engine interface shared by training (`gppo train`) and evaluation (`gppo eval`).

An engine turns prompts into sampled completions and records, for every generated token, the
behaviour policy's log-probability of the sampled token and, on request, mu's top-K ids and
log-probs, computed from the same (temperature-scaled) logits that were sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` means greedy decoding.

    `top_p < 1` truncates the sampling distribution; the recorded log-probs are then those of the
    truncated distribution, which is not the one the trainer recomputes: keep `top_p=1` for
    training rollouts (evaluation may use the field's protocol, e.g. 0.95).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    n: int = 1  # completions per prompt
    top_k_logprobs: int = 0  # record mu's top-K ids and log-probs per generated token (0: none)
    seed: int | None = None


@dataclass
class Generation:
    """One sampled completion of one prompt.

    `logprobs[t]` is log mu(completion_ids[t] | prefix) under the sampling temperature;
    `topk_ids[t]` / `topk_logprobs[t]` are mu's K most probable tokens at step t (descending).
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    finish_reason: str = "stop"  # "stop" (EOS) or "length" (hit max_new_tokens)


class RolloutEngine(Protocol):
    """Anything that can sample completions: `HFEngine` (CPU/GPU, transformers) or `VLLMEngine`."""

    max_top_k_logprobs: int  # the largest K it can record (vLLM caps it; HF has no cap)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt, grouped by prompt in prompt order."""
        ...
