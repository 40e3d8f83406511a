"""Asynchronous rollouts (`--async_rollouts`): generation runs in a thread of its own while the
trainer updates, with the staleness bounded, weights handed to the engine in flight, and each
token's sampling version recorded (docs/design.md, "Asynchronous training"). This module holds
what both ways of batching share (the engine's `EngineGate`, the `SamplingWorker` base, the
staleness metrics) and the wave-by-wave worker (`--async_batching waves`); continuous batching,
the default, is gppo.trainer.group_stream.

Versions: version v is the policy after v steps, so step t trains with version t and publishes
version t + 1. A batch ("wave") is what `RolloutGenerator(w)` samples for step w, with its seeds and
data; wave w is only started once the engine holds a version >= w - max_staleness (AReaL's bound on
submission), so no token trained at step t was sampled more than max_staleness versions before t,
and no sampled work is thrown away. Without partial rollouts a wave is sampled by one version and
new weights wait for the wave to end; with them the engine loads new weights between two decoding
steps, recomputes the KV cache of the completions under way, and records each token's version.

Checkpoints hold the data source's state at the start of the first wave not yet trained on: a
resumed run samples that wave and the later ones again, with the checkpoint's weights (with
max_staleness 0 that is exactly what the uninterrupted run did).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import torch

from gppo.trainer.batch import Rollout


class EngineGate:
    """The rollout engine, shared by the sampling worker and the trainer (new weights, evaluation),
    and `version`, the step whose weights the engine holds. One owner at a time (`owned`); new
    weights (`publish`) load as soon as no one samples, or at the owner's next `boundary` (partial
    rollouts)."""

    def __init__(self, load: Callable[[], None], version: int = 0):
        self.version = version
        self.closed = False
        self.load_seconds = 0.0  # time spent loading weights into the engine, in total
        self._load = load
        self.changed = threading.Condition()  # every change of the state below, under its lock
        self._owned = False
        self._pending: int | None = None  # a version published and not loaded yet

    @property
    def pending(self) -> bool:
        """Whether published weights wait to load (read under the lock)."""
        return self._pending is not None

    def wait_for(self, ready: Callable[[], bool]) -> bool:
        """Wait until `ready()` (read under the gate's lock) or the gate closes; False if closed."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or ready())
            return not self.closed

    def claim(self, ready: Callable[[], bool] = lambda: True) -> bool:
        """Own the engine once no one does, no weights wait to load and `ready()`; False if the gate
        closed first. `ready` and what runs right after a claim see a consistent state."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or (not self._owned and self._pending is None and ready()))
            if self.closed:
                return False
            self._owned = True
            return True

    def release(self) -> None:
        with self.changed:
            self._owned = False
            self.changed.notify_all()

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        if not self.claim():
            raise RuntimeError("the asynchronous rollout engine was closed")
        try:
            yield
        finally:
            self.release()

    def boundary(self, load: bool = True) -> int:
        """Between two decoding steps of the owner: load published weights, if any and `load`
        (partial rollouts); the version the next step samples with. Raises EngineClosed once closed."""
        with self.changed:
            if self.closed:
                raise EngineClosed("the run stopped while this batch was sampled")
            if load and self._pending is not None:
                self._load_pending()
            return self.version

    def publish(self, version: int) -> float:
        """Hand the trainer's weights of `version` to the engine; returns the seconds waited for the
        engine to be free (the owner's batch to end, or its next decoding step)."""
        start = time.perf_counter()
        with self.changed:
            self._pending = version
            self.changed.notify_all()
            self.changed.wait_for(lambda: self._pending is None or not self._owned or self.closed)
            waited = time.perf_counter() - start
            if self._pending is not None and not self.closed:
                self._load_pending()
            return waited

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def _load_pending(self) -> None:  # under the lock
        start = time.perf_counter()
        self._load()
        self.load_seconds += time.perf_counter() - start
        self.version, self._pending = self._pending, None
        self.changed.notify_all()


class EngineClosed(RuntimeError):
    """Raised inside a partial rollout's decoding loop when the run stops: the batch is dropped."""


class SamplingWorker:
    """What the two asynchronous workers share (`AsyncRollouts`, gppo.trainer.group_stream's
    `GroupStream`): the engine's gate, a thread that runs `_sample` and hands its error to the
    trainer, the weights it publishes, and the idle time of the engine (the worker waiting for the
    gate) and of the trainer (waiting for work or for the engine to take new weights)."""

    thread_name = "gppo-sampling"

    def __init__(self, gate: EngineGate):
        self.gate = gate
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._engine_idle = self._trainer_idle = 0.0  # seconds, in total
        self._engine_idle_since: float | None = None  # since when the worker waits for the gate
        self._last_take = (time.perf_counter(), 0.0, 0.0)  # (time, engine idle, trainer idle) then

    def _launch(self) -> None:
        self._last_take = (time.perf_counter(), 0.0, 0.0)
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._sample()
        except EngineClosed:
            return
        except BaseException as err:  # raised to the trainer by `_wait`
            with self.gate.changed:
                self._error = err
                self.gate.changed.notify_all()
        finally:
            self._engine_idle_since = None

    def _sample(self) -> None:
        raise NotImplementedError

    def _claim(self, ready: Callable[[], bool]) -> bool:
        """`EngineGate.claim`, the wait counted as the engine's idle time."""
        self._engine_idle_since = time.perf_counter()
        claimed = self.gate.claim(ready)
        self._engine_idle += time.perf_counter() - self._engine_idle_since
        self._engine_idle_since = None
        return claimed

    def _wait(self, ready: Callable[[], bool]) -> None:
        """The trainer waits until `ready()` (under the gate's lock), counted as its idle time; the
        worker's error, if any, is raised here."""
        start = time.perf_counter()
        if not self.gate.wait_for(lambda: self._error is not None or ready()):
            raise RuntimeError("the asynchronous rollout engine was closed")
        if self._error is not None:
            raise self._error
        self._trainer_idle += time.perf_counter() - start

    def _interval(self) -> tuple[float, dict]:
        """Since the last take: the seconds the engine sampled, and both idle fractions."""
        now = time.perf_counter()
        engine = self._engine_idle + (now - self._engine_idle_since if self._engine_idle_since else 0.0)
        then, engine_then, trainer_then = self._last_take
        self._last_take = (now, engine, self._trainer_idle)
        wall = max(now - then, 1e-9)
        return wall - (engine - engine_then), {
            "staleness/engine_idle_frac": min((engine - engine_then) / wall, 1.0),
            "staleness/trainer_idle_frac": min((self._trainer_idle - trainer_then) / wall, 1.0),
        }

    def publish(self, version: int) -> dict:
        """The trainer's weights of `version` to the engine (see `EngineGate.publish`)."""
        loaded = self.gate.load_seconds
        self._trainer_idle += self.gate.publish(version)
        return {"perf/weight_sync_seconds": self.gate.load_seconds - loaded}

    def close(self) -> None:
        """Stop sampling: the work under way is dropped at the engine's next decoding step."""
        self.gate.close()
        if self._thread is not None:
            self._thread.join()


class AsyncRollouts(SamplingWorker):
    """The sampling worker of an asynchronous run wave by wave (--async_batching waves): waves `first`,
    `first + 1`, ... `last - 1`, each `sample(w, policy_version)` (the RolloutGenerator) as soon as
    the gate allows, kept until the trainer `take`s them. The data `source` is only read by the
    worker, between waves."""

    thread_name = "gppo-async-rollouts"

    def __init__(
        self,
        sample: Callable[[int, Callable[[], int] | None], tuple[Rollout | None, dict]],
        source,
        gate: EngineGate,
        max_staleness: int,
        partial: bool,
        last: int,
    ):
        super().__init__(gate)
        self.sample, self.source = sample, source
        self.max_staleness, self.partial, self.last = max_staleness, partial, last
        self._done: dict[int, tuple[Rollout | None, dict]] = {}
        self._source_at: dict[int, dict] = {}  # the source's state at the start of each wave begun
        self._next_wave = 0

    def start(self, first: int) -> None:
        """Start sampling at wave `first` (the run's current step, after a resume too), whose weights
        the engine holds."""
        self.gate.version = self._next_wave = first
        self._launch()

    def _sample(self) -> None:
        for wave in range(self._next_wave, self.last):
            if not self._claim(lambda w=wave: self.gate.version >= w - self.max_staleness):
                return
            try:
                with self.gate.changed:  # what `checkpoint_state` reads, before the wave takes from the source
                    self._source_at[wave] = self.source.state_dict()
                version = self.gate.version
                # between decoding steps: new weights with partial rollouts, and a stop
                rollout, stats = self.sample(wave, lambda: self.gate.boundary(load=self.partial))
            finally:
                self.gate.release()
            # vLLM's tool rollouts record no versions: the wave was sampled by one
            if rollout is not None and rollout.versions is None:
                rollout = dataclasses.replace(rollout, versions=torch.full_like(rollout.token_ids, version))
            with self.gate.changed:
                self._done[wave] = (rollout, stats)
                self.gate.changed.notify_all()

    def take(self, step: int) -> tuple[Rollout | None, dict]:
        """Wave `step` once sampled, with the staleness/ metrics of the interval since the last take."""
        self._wait(lambda: step in self._done)
        with self.gate.changed:
            rollout, stats = self._done.pop(step)
            depth = len(self._done)
            for wave in [w for w in self._source_at if w <= step]:
                del self._source_at[wave]
        return rollout, {**stats, "staleness/buffer_depth": depth, **self._interval()[1]}

    def checkpoint_state(self, step: int) -> dict:
        """The data source's state at the start of wave `step` ("data"): where a resumed run starts sampling."""
        with self.gate.changed:  # the worker has recorded it, or has not taken from the source since
            return {"data": self._source_at[step] if step in self._source_at else self.source.state_dict()}


def staleness_metrics(rollout: Rollout, step: int) -> dict:
    """How many versions behind step `step` the model's tokens of `rollout` were sampled: per token,
    per sample (its oldest token), and the distinct versions in each completion."""
    valid = rollout.response_mask.bool()
    behind = step - rollout.versions
    rows = valid.any(1)
    tokens = behind[valid].double()
    samples = behind.masked_fill(~valid, -1).amax(1)[rows].double()
    versions = torch.tensor(
        [len(set(v[m].tolist())) for v, m in zip(rollout.versions[rows], valid[rows])], dtype=torch.float64
    )
    values = {
        "staleness/token_min": tokens.min(),
        "staleness/token_mean": tokens.mean(),
        "staleness/token_max": tokens.max(),
        "staleness/sample_min": samples.min(),
        "staleness/sample_mean": samples.mean(),
        "staleness/sample_max": samples.max(),
        "staleness/versions_per_completion_mean": versions.mean(),
        "staleness/versions_per_completion_max": versions.max(),
    }
    return {key: value.item() for key, value in values.items()}


def mismatch_by_lag(rollout: Rollout, step: int) -> dict:
    """KL(mu || pi_old) by the k3 estimator, mean(e^d - 1 - d) with d = log pi_old(a) - log mu(a),
    over the tokens sampled j versions behind, for each lag j present (`staleness/mismatch_kl_k3/lag{j}`).
    Empty when pi_old was not recomputed."""
    if rollout.logp_old is None:
        return {}
    valid = rollout.response_mask.bool()
    lag = (step - rollout.versions)[valid].cpu()
    d = (rollout.logp_old - rollout.logp_behavior)[valid].cpu().double()
    k3 = torch.expm1(d) - d
    return {f"staleness/mismatch_kl_k3/lag{j}": k3[lag == j].mean().item() for j in lag.unique().tolist()}
