"""Continuous batching for asynchronous runs (`--async_rollouts`, `--async_batching groups`): the
sampling worker keeps the engine's batch full, one group (a prompt's group_size completions) at a
time, and a step trains on the first prompts_per_step groups that finish (docs/design.md,
"Asynchronous training").

Groups are numbered by the order they are taken from the data source (their key); group k has the
row seeds the synchronous run gives group k % P of step k // P (P = prompts_per_step), so at
--max_staleness 0, where nothing can be sampled ahead, the stream is the synchronous run bit for bit.

Staleness. Admission (AReaL's bound): while the trainer is at step t and the engine holds version v,
a group may start only if the groups running or finished and not yet trained stay below
(v + max_staleness + 1 - t) * P, the most that steps t .. v + max_staleness can train. Groups finish
out of order, so admission alone does not bound staleness: a group whose oldest token is more than
max_staleness versions behind the step that would train it is dropped there and counted
(`staleness/dropped_samples`). Without partial rollouts no group runs while new weights wait: the
worker stops starting groups, and the weights load once the running ones end.

Dynamic sampling: a group whose rewards are all equal is dropped when it finishes and frees its
slot; a step trains on fewer than P groups (or on none) once (1 + max_resample_rounds) * P groups
have finished since the last step, as the synchronous run stops after that many rounds.

Checkpoints hold the data source's state before the lowest group not yet trained on, and the keys
above it already trained on (or dropped): a resumed run samples the others again, from the same
prompts and seeds, with the checkpoint's weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gppo.trainer.async_rollouts import AsyncRollouts, EngineClosed, EngineGate, SamplingWorker
from gppo.trainer.batch import Rollout
from gppo.trainer.config import TrainConfig
from gppo.trainer.generation import RolloutGenerator, SampledGroups


class _Group:
    """A finished group: its key, problem, completions, rewards [group_size], scores and warnings."""

    def __init__(self, key: int, problem, gens, rewards: torch.Tensor, accuracy, warnings: int):
        self.key, self.problem, self.gens, self.rewards = key, problem, gens, rewards
        self.accuracy, self.warnings = accuracy, warnings
        self.oldest = min((v for g in gens for v in (g.versions or [])), default=None)


class GroupStream(SamplingWorker):
    """The sampling worker of an asynchronous run with continuous batching (see the module
    docstring); `take(step)` hands the trainer step `step`'s groups. Same interface as
    `AsyncRollouts`, its wave-by-wave counterpart."""

    thread_name = "gppo-group-stream"

    def __init__(self, generator: RolloutGenerator, gate: EngineGate, max_staleness: int, partial: bool, last: int):
        super().__init__(gate)
        c = generator.config
        self.generator, self.source = generator, generator.source
        self.max_staleness, self.partial, self.last = max_staleness, partial, last
        self.per_step, self.budget = c.prompts_per_step, (1 + c.max_resample_rounds) * c.prompts_per_step
        self._step = 0  # the step whose groups the trainer takes next
        self._next_key: int | None = None  # set by `restore`, else by `start`
        self._skip: set[int] = set()  # keys trained on before a resume: passed over
        self._source_at: dict[int, dict] = {}  # open key -> the source's state before its problem
        self._problems: dict[int, object] = {}  # running key -> its problem
        self._closed_keys: set[int] = set()  # keys above the lowest open one, trained on or dropped
        self._ready: list[_Group] = []  # finished groups that train, in finishing order
        self._filtered: list[_Group] = []  # finished groups of equal rewards since the last take
        self._dropped = 0  # completions dropped for staleness since the last take

    # ------------------------------------------------------------------------------ the worker
    def start(self, first: int) -> None:
        """Start sampling for step `first` (the run's current step, after a resume too), whose
        weights the engine holds."""
        self.gate.version = self._step = first
        if self._next_key is None:  # a run's start, or a checkpoint of wave-by-wave sampling
            self._next_key = first * self.per_step
        self._launch()

    def _sample(self) -> None:
        params = self.generator.sampling(None, lambda: self.gate.boundary(load=self.partial))
        while self._claim(lambda: self._room() > 0):
            try:
                self.generator.engine.stream(self._feed, params, self._finished)
            finally:
                self.gate.release()

    def _room(self) -> int:
        """How many groups may start now (under the gate's lock): what steps `_step` .. version +
        max_staleness (and before `last`) can train, less the groups running or not yet trained."""
        if not self.partial and self.gate.pending:  # new weights wait for the running groups to end
            return 0
        pending = len(self._problems) + len(self._ready)
        return (min(self.gate.version + self.max_staleness + 1, self.last) - self._step) * self.per_step - pending

    def _feed(self, most: int) -> list:
        """Up to `most` new groups, as the staleness bound allows (the engine's `feed`)."""
        requests = []
        with self.gate.changed:
            if self.gate.closed:
                raise EngineClosed("the run stopped while groups were sampled")
            for _ in range(max(0, min(most, self._room()))):
                key = self._next_key
                self._next_key += 1
                self._source_at[key] = self.source.state_dict()
                [problem] = self.source.take(1)
                if key in self._skip:  # trained on before the resume
                    self._skip.discard(key)
                    self._close(key)
                    continue
                self._problems[key] = problem
                requests.append(self.generator.request(problem, key))
        return requests

    def _finished(self, key: int, gens) -> None:
        """A group's completions have all ended: score it, and keep it (or drop it: dynamic sampling)."""
        problem = self._problems[key]
        rewards, accuracy, warnings = self.generator.score({key: problem}, gens)
        group = _Group(key, problem, gens, rewards[0], accuracy, warnings)
        keep = bool(self.generator.informative(rewards)[0])
        with self.gate.changed:
            del self._problems[key]
            (self._ready if keep else self._filtered).append(group)
            if not keep:
                self._close(key)
            self.gate.changed.notify_all()

    def _close(self, key: int) -> None:
        """`key` is trained on or dropped (under the lock): forget what a checkpoint no longer needs."""
        self._closed_keys.add(key)
        lowest = min(self._source_at)
        while lowest in self._closed_keys:
            self._closed_keys.discard(lowest)
            del self._source_at[lowest]
            if not self._source_at:
                break
            lowest = min(self._source_at)

    # ------------------------------------------------------------------------------ the trainer's side
    def take(self, step: int) -> tuple[Rollout | None, dict]:
        """Step `step`'s batch: the first prompts_per_step groups that finished within the staleness
        bound (in key order), with the rollout/ and staleness/ metrics since the last take."""
        self._wait(lambda: self._enough(step))
        with self.gate.changed:
            groups = sorted(self._ready[: self.per_step], key=lambda g: g.key)
            del self._ready[: self.per_step]
            filtered, self._filtered = self._filtered, []
            dropped, self._dropped = self._dropped, 0
            for group in groups:
                self._close(group.key)
            self._step = step + 1
            depth = len(self._ready)
            self.gate.changed.notify_all()
        sampled = SampledGroups()
        for group in sorted(groups + filtered, key=lambda g: g.key):
            keep = torch.tensor([group in groups])
            sampled.add(group.gens, group.rewards[None], group.accuracy, group.warnings, keep)
        sampled.rounds = -(-len(groups + filtered) // self.per_step)
        sampling_seconds, idle = self._interval()
        rollout, stats = self.generator.batch(step, sampled, sampling_seconds)
        return rollout, {**stats, "staleness/buffer_depth": depth, "staleness/dropped_samples": dropped, **idle}

    def _enough(self, step: int) -> bool:
        """Under the lock: drop the finished groups too stale for `step`; whether step `step` can
        train (prompts_per_step groups, or the resampling budget spent)."""
        stale = [g for g in self._ready if g.oldest is not None and step - g.oldest > self.max_staleness]
        for group in stale:
            self._ready.remove(group)
            self._dropped += len(group.gens)
            self._close(group.key)
        if stale:
            self.gate.changed.notify_all()  # their slots are free
        return len(self._ready) >= self.per_step or len(self._ready) + len(self._filtered) >= self.budget

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_state(self, step: int) -> dict:
        """What a resumed run starts from: the source's state before the lowest group not trained on
        ("data"), that group's key and the keys above it trained on or dropped ("stream")."""
        with self.gate.changed:
            if not self._source_at:
                return {"data": self.source.state_dict(), "stream": {"next_key": self._next_key, "skip": []}}
            lowest = min(self._source_at)
            skip = sorted(self._closed_keys)
            return {"data": self._source_at[lowest], "stream": {"next_key": lowest, "skip": skip}}

    def restore(self, stream: dict) -> None:
        """Continue from a checkpoint's "stream" (`checkpoint_state`); the source is restored apart."""
        self._next_key, self._skip = stream["next_key"], set(stream["skip"])


def sampling_worker(
    config: TrainConfig, generator: RolloutGenerator, load: Callable[[], None]
) -> GroupStream | AsyncRollouts | None:
    """The asynchronous run's sampling worker (None for the other regimes): `GroupStream`, or
    `AsyncRollouts` with --async_batching waves; `load` hands the engine the trainer's weights."""
    if not config.async_rollouts:
        return None
    gate = EngineGate(load)
    if config.async_batching == "groups":
        return GroupStream(generator, gate, config.staleness_bound(), config.partial_rollouts, last=config.steps)
    return AsyncRollouts(
        generator, generator.source, gate, config.staleness_bound(), config.partial_rollouts, last=config.steps
    )
