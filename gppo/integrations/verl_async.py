"""gppo's policy loss in verl 0.9.1's fully-async trainer: `python -m gppo.integrations.verl_async`, verl's
`verl.experimental.fully_async_policy.fully_async_main` (same config, same overrides) with three of its
classes extended, each in the process where verl builds it:
- the rollouter (`AsyncRollouter`): its LLM client (`VersionedAsyncClient`) keeps, for every part of
  a request that verl's partial rollout aborts at a weight sync and resumes, the weight version that
  generated the part (the server's `global_steps`) and, when the loss mode reads it, mu's top-K
  (verl_topk_server.TopKvLLMHttpServer); it joins the parts into one generate call per turn. Its
  agent-loop workers (`AsyncAgentLoopWorker`) lay them against each sample's response mask: the
  version of every response token (TOKEN_VERSIONS_KEY, -1 where response_mask is 0) and mu's top-K
  as verl's teacher fields (verl_topk.teacher_layout);
- the trainer (`AsyncTrainer`): with a top-K estimator the actor's loss function is
  gppo.integrations.verl.topk_ppo_loss and every update is flagged `distillation_use_topk`
  (verl_topk.flag_topk_updates); each step adds `staleness/...` (`staleness_metrics`) to verl's metrics;
- the task runner (`AsyncTaskRunner`): builds those two in place of verl's.
Other loss modes run the same way without top-K. Samples go through verl's message queue, staleness
control (`async_training.staleness_threshold`, `trigger_parameter_sync_step`) and partial rollouts
unchanged.
"""

from __future__ import annotations

import contextvars
import inspect
from functools import partial
from pathlib import Path

import hydra
import numpy as np
import ray
from omegaconf import DictConfig

import gppo
from gppo.integrations.verl import MODES, topk_ppo_loss
from gppo.integrations.verl_topk import (
    TopKRecordingWorker,
    flag_topk_updates,
    install_topk_replica,
    put_topk_in_batch,
    refuse_unservable,
    response_runs,
    rollout_top_k,
)
from gppo.integrations.vllm_topk import TOKEN_VERSIONS_FIELD, TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD, TOPK_REQUEST

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.fully_async_policy import fully_async_main
    from verl.experimental.fully_async_policy.fully_async_rollouter import (
        FullyAsyncAgentLoopManager,
        FullyAsyncRollouter,
    )
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
except ModuleNotFoundError as missing:  # verl installed without the fully-async trainer's dependencies
    raise ImportError(
        f"gppo.integrations.verl_async extends verl's fully-async trainer, which imports {missing.name!r}, not "
        f"installed: pip install 'verl[vllm]>=0.9.1,<0.10', or pip install {missing.name}"
    ) from missing

TOKEN_VERSIONS_KEY = "gppo_token_versions"  # non-tensor batch: the weight version of each response token
GPPO_TARGET = "gppo.integrations.verl.GPPOPolicyLossConfig"
_parts: contextvars.ContextVar = contextvars.ContextVar("gppo_request_parts", default=None)


def staleness_metrics(current_version: int, batch) -> dict[str, float]:
    """`staleness/...` (the names of gppo's own asynchronous trainer), in weight versions behind the
    trainer's `current_version` at the step's start: per sample, from verl's min_global_steps (the
    version of its first generated part, so its oldest token): sample_min / _mean / _max; per response
    token (response_mask 1), from TOKEN_VERSIONS_KEY: token_min / _mean / _max, and the distinct
    versions of each sample's tokens, versions_per_completion_mean / _max (above 1 only where a
    partial rollout resumed a request on newer weights)."""
    rows = batch.non_tensor_batch
    oldest = np.array([v for v in rows["min_global_steps"] if v is not None], dtype=np.int64)
    if not oldest.size:
        return {}
    behind = current_version - oldest
    metrics = {
        "staleness/sample_min": float(behind.min()),
        "staleness/sample_mean": float(behind.mean()),
        "staleness/sample_max": float(behind.max()),
    }
    if TOKEN_VERSIONS_KEY in rows:
        mask = batch.batch["response_mask"].bool().numpy()
        tokens = [
            np.asarray(versions)[row[: len(versions)]]
            for versions, row in zip(rows[TOKEN_VERSIONS_KEY], mask)
            if versions is not None and row[: len(versions)].any()
        ]
        if tokens:
            behind = current_version - np.concatenate(tokens)
            distinct = np.array([len(set(versions.tolist())) for versions in tokens])
            metrics.update(
                {
                    "staleness/token_min": float(behind.min()),
                    "staleness/token_mean": float(behind.mean()),
                    "staleness/token_max": float(behind.max()),
                    "staleness/versions_per_completion_mean": float(distinct.mean()),
                    "staleness/versions_per_completion_max": float(distinct.max()),
                }
            )
    return metrics


def token_versions(response_ids: list[int], response_mask: list[int], turns: list[tuple]) -> list[int]:
    """The weight version of each response token, -1 where response_mask is 0 (prompt-side tool
    tokens); `turns`: (token_ids, topk_ids, topk_logprobs, versions) per generate call, matched to
    the response as verl_topk.response_runs does."""
    versions = [-1] * len(response_mask)
    for start, stop, turn in response_runs(response_ids, response_mask, turns):
        if turn[3] is None or len(turn[3]) < stop - start:
            raise gppo.GPPOInputError(
                f"the rollout recorded weight versions for {len(turn[3] or [])} tokens of a {stop - start}-token "
                "generate call; every generated token needs one (VersionedAsyncClient records them)"
            )
        versions[start:stop] = turn[3][: stop - start]
    return versions


def rebind(function, **names) -> None:
    """Make `function` (one of verl's, which builds a class by its global name) read gppo's classes
    under `names`. Its globals are its module's or, where Ray shipped verl's class by value (a class
    hidden behind its @ray.remote wrapper), a copy of their own; in an actor, Ray's tracing wraps it."""
    inspect.unwrap(getattr(function, "__func__", function)).__globals__.update(names)


# -- the rollouter's side ----------------------------------------------------------------------------------


class PartRecordingClient(LLMServerClient):
    """verl's LLM server client; inside `VersionedAsyncClient.generate`, each server call (one part of
    a request resumed after an abort) leaves its token count, weight version and top-K in `_parts`."""

    async def generate(self, request_id, **kwargs):
        output = await super().generate(request_id, **kwargs)
        parts = _parts.get()
        if parts is not None:
            ids = output.extra_fields.pop(TOPK_IDS_FIELD, None)
            logprobs = output.extra_fields.pop(TOPK_LOGPROBS_FIELD, None)
            parts.append((len(output.token_ids), output.extra_fields.get("global_steps"), ids, logprobs))
        return output


class VersionedAsyncClient(FullyAsyncLLMServerClient, PartRecordingClient):
    """verl's fully-async client (it resumes a request aborted at a weight sync until it ends), whose
    joined output also carries, in extra_fields, each token's weight version (TOKEN_VERSIONS_FIELD) and,
    when requested, mu's top-K of every token (TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD), part after part."""

    async def generate(self, request_id, **kwargs):
        parts = []
        token = _parts.set(parts)
        try:
            output = await super().generate(request_id, **kwargs)
        finally:
            _parts.reset(token)
        recorded = sum(count for count, *_ in parts)
        if recorded != len(output.token_ids):
            raise gppo.GPPOInputError(
                f"the {len(parts)} server calls of request {request_id!r} returned {recorded} tokens, the joined "
                f"output has {len(output.token_ids)}: the versions and top-K of its parts cannot be laid out"
            )
        output.extra_fields[TOKEN_VERSIONS_FIELD] = [version for count, version, *_ in parts for _ in range(count)]
        if kwargs["sampling_params"].get(TOPK_REQUEST):
            if any(ids is None or len(ids) < count for count, _, ids, _ in parts):
                raise gppo.GPPOInputError(
                    f"a part of request {request_id!r} came back without mu's top-K of every token, which "
                    f"the loss mode reads: the rollout server must be verl_topk_server.TopKvLLMHttpServer "
                    "(actor_rollout_ref.rollout.name=vllm under `python -m gppo.integrations.verl_async`)"
                )
            output.extra_fields[TOPK_IDS_FIELD] = [row for count, _, ids, _ in parts for row in ids[:count]]
            output.extra_fields[TOPK_LOGPROBS_FIELD] = [row for count, _, _, lps in parts for row in lps[:count]]
        return output


class AsyncAgentLoopWorkerClass(TopKRecordingWorker, AgentLoopWorker):
    """verl's agent-loop worker (the one the fully-async rollouter runs) that stores, with each
    training sample, the weight version of its response tokens and, when the loss mode reads it,
    mu's top-K (TopKRecordingWorker)."""

    def store_recorded(self, output, prompt_ids, response_ids, turns) -> None:
        output.extra_fields[TOKEN_VERSIONS_KEY] = token_versions(response_ids, output.response_mask, turns)
        if self.rollout_top_k:
            super().store_recorded(output, prompt_ids, response_ids, turns)


AsyncAgentLoopWorker = ray.remote(AsyncAgentLoopWorkerClass)  # by reference (verl_topk: the actors' names)


class AsyncAgentLoopManager(FullyAsyncAgentLoopManager):
    """verl's fully-async agent-loop manager with AsyncAgentLoopWorker workers."""

    agent_loop_workers_class = AsyncAgentLoopWorker


class AsyncRollouterClass(FullyAsyncRollouter.__ray_actor_class__):
    """verl's fully-async rollouter, whose rollout records versions and top-K (module docstring)."""

    async def _init_async_rollout_manager(self):
        build = super()._init_async_rollout_manager
        rebind(build, FullyAsyncLLMServerClient=VersionedAsyncClient, FullyAsyncAgentLoopManager=AsyncAgentLoopManager)
        if rollout_top_k(self.config):
            install_topk_replica()
        await build()


AsyncRollouter = ray.remote(**FullyAsyncRollouter._default_options)(AsyncRollouterClass)


# -- the trainer's side ------------------------------------------------------------------------------------


class AsyncTrainerClass(FullyAsyncTrainer.__ray_actor_class__):
    """verl's fully-async trainer with the top-K loss where the loss mode reads mu's top-K, and the
    `staleness/...` metrics of every step."""

    async def init_workers(self):
        await super().init_workers()
        if rollout_top_k(self.config):
            actor = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.actor_rollout_wg.set_loss_fn(partial(topk_ppo_loss, config=actor))
            flag_topk_updates(self.actor_rollout_wg)

    def _collect_metrics_from_samples(self, batch, metrics):
        super()._collect_metrics_from_samples(batch, metrics)
        metrics.update(staleness_metrics(self.current_param_version, batch))


AsyncTrainer = ray.remote(**FullyAsyncTrainer._default_options)(AsyncTrainerClass)


class AsyncTaskRunnerClass(fully_async_main.FullyAsyncTaskRunner.__ray_actor_class__):
    """verl's fully-async task runner, building AsyncTrainer and AsyncRollouter (by the names verl's
    methods read, in this process)."""

    def run(self, config):
        rebind(self._create_trainer, FullyAsyncTrainer=AsyncTrainer)
        rebind(self._create_rollouter, FullyAsyncRollouter=AsyncRollouter)
        return super().run(config)


AsyncTaskRunner = ray.remote(**fully_async_main.FullyAsyncTaskRunner._default_options)(AsyncTaskRunnerClass)


def prepare_config(config: DictConfig) -> int:
    """Check a composed fully-async config for gppo's loss and return K of mu's top-K the rollout
    records (0: none); with a top-K estimator, set `policy_loss.topk_source=batch` (and vLLM's
    max_logprobs where K exceeds its default). Refuses, naming the setting, its value and the fix,
    what the async run cannot serve."""
    actor = config.actor_rollout_ref.actor
    mode = actor.policy_loss.get("loss_mode")
    if mode not in MODES:
        return 0
    target = actor.policy_loss.get("_target_")
    if target != GPPO_TARGET:
        raise gppo.GPPOConfigError(
            f"actor_rollout_ref.actor.policy_loss._target_={target!r}: loss_mode={mode!r} reads its settings "
            f"from gppo's config class; set actor_rollout_ref.actor.policy_loss._target_={GPPO_TARGET} (with "
            "'+actor_rollout_ref.actor.policy_loss.bypass_mode=${algorithm.rollout_correction.bypass_mode}' and "
            "'+actor_rollout_ref.actor.policy_loss.use_v1=${trainer.use_v1}', docs/verl.md)"
        )
    k = rollout_top_k(config)  # instantiates the loss config: the plugin's start-up checks
    if not k:
        return 0
    refuse_unservable(
        config,
        k,
        {
            "actor_rollout_ref.rollout.calculate_log_probs": (
                (True,),
                "mu's log-probs of the sampled tokens anchor the top-K estimator (bypass mode)",
            )
        },
    )
    put_topk_in_batch(config, k)
    return k


CONFIG_DIR = str(Path(fully_async_main.__file__).parent / "config")


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    """verl's fully_async_main (same config, same overrides) with gppo's rollouter and trainer."""
    prepare_config(config)
    verl_main = fully_async_main.main.__wrapped__  # the function under verl's own hydra.main
    rebind(verl_main, FullyAsyncTaskRunner=AsyncTaskRunner)
    verl_main(config)


if __name__ == "__main__":
    # through the module's import name, so that the classes Ray pickles by reference resolve in the
    # other processes (verl_topk's reason)
    from gppo.integrations import verl_async

    verl_async.main()
