"""mu's top-K from verl's vLLM rollout to the actor: `python -m gppo.integrations.verl_topk`, verl's
main_ppo for the loss modes whose estimator reads mu's top-K (docs/verl.md, "Top-K and nucleus
estimators").

verl 0.9.1's vLLM server keeps only the sampled token's log-prob. For a gppo loss mode that needs
mu's top-K (gppo_dppo_topk_tv / _kl, gppo_cppo, any mode with estimator topk or topp), this launcher
runs verl's main_ppo (v1 trainer) with three of verl's classes extended, each where verl builds it:
- the vLLM server (`verl_topk_server.TopKvLLMHttpServer`, through verl's rollout-replica registry
  in the task-runner process) asks vLLM for `logprobs=K` on the requests that carry TOPK_REQUEST
  and returns mu's K ids and log-probs of every generated token in `TokenOutput.extra_fields`
  (vLLM's logprobs_mode `processed_logprobs`: the distribution sampled, temperature applied);
- the agent-loop worker (`TopKAgentLoopWorker`, through `rollout.agent.agent_loop_manager_class`)
  adds TOPK_REQUEST to training requests, keeps the top-K of each of a trajectory's generate calls
  (one per assistant turn) and lays them out at those calls' tokens as verl's teacher fields
  ([P + R, K] per sample, entry p predicting token p + 1), which verl stores with the sample and
  packs for the actor;
- the trainer (`topk_trainer` over the class of `trainer.v1.trainer_mode`) sets the actor's loss
  function to `gppo.integrations.verl.topk_ppo_loss` and flags every update
  `distillation_use_topk`, so that verl's FSDP engine hands that loss the logits to gather pi at
  mu's ids.
Other loss modes run verl's main_ppo unchanged. Multi-turn agent loops (verl's tool_agent with
`rollout.multi_turn.enable`): tool tokens (response_mask 0) have no mu; their entries hold zeros,
which the loss never reads (it selects by response_mask).
"""

from __future__ import annotations

import contextvars
from functools import partial

import hydra
import ray
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import TensorDict

import gppo

# first: the plugin refuses a verl outside the versions this module extends, naming the install line
from gppo.integrations.verl import MODES, TOPK_IDS_KEY, TOPK_LOGPROBS_KEY, topk_ppo_loss
from gppo.integrations.vllm_topk import TOKEN_VERSIONS_FIELD, TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD, TOPK_REQUEST

try:
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.main_ppo import main as verl_main
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ, AgentLoopWorkerTQ
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.device import auto_set_device
    from verl.workers.rollout.replica import RolloutReplicaRegistry
except ModuleNotFoundError as missing:  # verl installed without its v1 trainer's dependencies
    raise ImportError(
        f"gppo.integrations.verl_topk extends verl's v1 trainer, which imports {missing.name!r}, not installed: "
        "pip install 'verl[verl-core]>=0.9.1,<0.10' (TransferQueue; verl[vllm] includes it), or "
        f"pip install {missing.name}"
    ) from missing

VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM's engine argument max_logprobs when unset: the largest K it returns


def rollout_top_k(config: DictConfig) -> int:
    """K of mu's top-K that the rollout must record for the actor's policy loss (0: none needed)."""
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    if policy_loss.get("loss_mode") not in MODES:
        return 0
    probe = OmegaConf.to_container(policy_loss, resolve=True)
    probe["topk_source"] = "batch"  # validated as if fed, to read K; prepare_config sets it for real
    try:
        return omega_conf_to_dataclass(OmegaConf.create(probe)).gppo_config().rollout_top_k
    except InstantiationException as error:  # hydra's wrapper around the plugin's own message
        if isinstance(error.__cause__, gppo.GPPOConfigError):
            raise error.__cause__ from None
        raise


def refuse_unservable(config: DictConfig, k: int, needs: dict | None = None) -> None:
    """Refuse the settings under which verl's vLLM rollout cannot record mu's top-K (K=`k`) for the
    actor, naming the setting, its value and the fix; `needs`: more settings, as {field: (allowed
    values, why)}."""
    mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    needs = {
        **(needs or {}),
        "actor_rollout_ref.rollout.name": (("vllm",), "only verl's vLLM server is extended"),
        "actor_rollout_ref.rollout.logprobs_mode": (
            ("processed_logprobs",),
            "mu's top-K must be of the distribution sampled (temperature applied)",
        ),
        "actor_rollout_ref.rollout.top_p": (
            (1,),
            "a top-p rollout's mu is 0 outside the nucleus while verl scores pi on the whole vocabulary",
        ),
        "actor_rollout_ref.rollout.top_k": (
            (-1, 0),
            "a top-k rollout's mu is 0 outside it while verl scores pi on the whole vocabulary",
        ),
        "actor_rollout_ref.rollout.disaggregation.enabled": (
            (False,),
            "verl's prefill/decode-disaggregated replica is not extended",
        ),
        "distillation.enabled": (
            (False,),
            f"mu's top-K travels in the batch under the teacher keys {TOPK_IDS_KEY} / {TOPK_LOGPROBS_KEY}",
        ),
    }
    for field, (allowed, why) in needs.items():
        value = OmegaConf.select(
            config, field, default=allowed[0] if allowed[0] is False else None, throw_on_missing=False
        )
        if value not in allowed:
            raise gppo.GPPOConfigError(
                f"{field}={value!r}: loss_mode={mode!r} needs mu's top-K (K={k}) from the rollout, and "
                f"{why}; set {field}={allowed[0]!r} or use a loss mode without a top-K estimator "
                "(e.g. gppo_dppo_binary_kl)"
            )


def prepare_config(config: DictConfig) -> int:
    """Set a composed main_ppo config up for mu's top-K from verl's vLLM rollout and return K; with a
    loss mode that needs no top-K, return 0 and leave the config as it is. Refuses what the rollout
    side cannot serve, naming the setting and its fix."""
    k = rollout_top_k(config)
    if not k:
        return 0
    rollout = config.actor_rollout_ref.rollout
    refuse_unservable(
        config,
        k,
        {"trainer.use_v1": ((True,), "the rollout's top-K reaches the actor through the v1 trainer's agent loop")},
    )
    manager = f"{__name__}.{TopKAgentLoopManager.__qualname__}"
    chosen = rollout.get("agent", {}).get("agent_loop_manager_class")
    if chosen not in (None, manager):
        raise gppo.GPPOConfigError(
            f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={chosen!r}: the rollout's top-K "
            f"needs gppo's agent-loop manager ({manager}); leave the setting null"
        )
    put_topk_in_batch(config, k)
    with open_dict(config):
        rollout.agent.agent_loop_manager_class = manager
    return k


def put_topk_in_batch(config: DictConfig, k: int) -> None:
    """Have the loss read mu's top-K from the batch (`policy_loss.topk_source=batch`) and vLLM return
    K log-probs per token (`max_logprobs`, where K exceeds vLLM's default); refuses a topk_source
    other than the batch and a max_logprobs below K, naming the setting and the fix."""
    rollout, policy_loss = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor.policy_loss
    if policy_loss.get("topk_source") not in (None, "batch"):
        raise gppo.GPPOConfigError(
            f"policy_loss.topk_source={policy_loss.topk_source!r}: this launcher puts mu's top-K "
            "in the batch (topk_source=batch); leave it null"
        )
    max_logprobs = (rollout.get("engine_kwargs", {}).get("vllm", {}) or {}).get("max_logprobs")
    if max_logprobs is not None and max_logprobs < k:
        raise gppo.GPPOConfigError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={max_logprobs} is below the "
            f"K={k} that loss_mode={policy_loss.loss_mode!r} reads; set it to {k} or more (or leave it unset)"
        )
    with open_dict(config):
        policy_loss.topk_source = "batch"
        if max_logprobs is None and k > VLLM_DEFAULT_MAX_LOGPROBS:
            rollout.engine_kwargs.vllm.max_logprobs = k


def response_runs(response_ids: list[int], response_mask: list[int], turns: list[tuple]) -> list[tuple]:
    """(start, stop, turn) for each maximal run of response_mask 1, matched in order to the generate
    call (`turns`: tuples whose first entry is the call's token ids) whose tokens it starts with: a run
    is one call's tokens, a prefix of them (the response cut at response_length, or a chat-template
    builder dropping a turn's last token); a call that left no token (all dropped) is skipped."""
    runs, start = [], None
    for t, generated in enumerate([*response_mask, 0]):
        if generated and start is None:
            start = t
        elif not generated and start is not None:
            runs.append((start, t))
            start = None
    matched, pending = [], iter(turns)
    for start, stop in runs:
        run = list(response_ids[start:stop])
        for turn in pending:
            if list(turn[0][: len(run)]) == run:
                break
        else:
            raise gppo.GPPOInputError(
                f"response tokens {start}..{stop - 1} (response_mask 1) are not the start of any remaining "
                f"generate call's tokens ({len(turns)} calls recorded): mu's top-K is recorded per call, so every "
                "generated token must come from one call (a request resumed after an abort, as in partial "
                "rollouts, counts as one call only under `python -m gppo.integrations.verl_async`, whose "
                "client joins its parts)"
            )
        matched.append((start, stop, turn))
    return matched


def teacher_layout(
    prompt_length: int, response_ids: list[int], response_mask: list[int], turns: list[tuple]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's mu top-K as verl's teacher fields: [P + R, K] ids (int32) and log-probs (float32),
    entry p holding the distribution that predicts token p + 1.

    `turns`: (token_ids, topk_ids, topk_logprobs, ...) of each generate call, in order, matched to the
    response by `response_runs`. A run starting at response token s takes its call's top-K at entries
    P - 1 + s onwards; the other entries (prompt, tool tokens, the last) hold id 0 and log-prob 0,
    which the loss never reads (response_mask)."""
    length = len(response_mask)
    k = next((len(turn[1][0]) for turn in turns if turn[1]), 0)
    ids = torch.zeros(prompt_length + length, k, dtype=torch.int32)
    logprobs = torch.zeros(prompt_length + length, k, dtype=torch.float32)
    for start, stop, turn in response_runs(response_ids, response_mask, turns):
        topk_ids, topk_logprobs = turn[1], turn[2]
        if topk_ids is None or len(topk_ids) < stop - start:
            raise gppo.GPPOInputError(
                f"the rollout recorded mu's top-K for {len(topk_ids or [])} tokens of a {stop - start}-token "
                "generate call; every generated token needs one"
            )
        rows = slice(prompt_length - 1 + start, prompt_length - 1 + stop)
        ids[rows] = torch.tensor(topk_ids[: stop - start], dtype=torch.int32)
        logprobs[rows] = torch.tensor(topk_logprobs[: stop - start], dtype=torch.float32)
    return ids, logprobs


def _load_topk_replica():
    from gppo.integrations.verl_topk_server import TopKvLLMReplica

    return TopKvLLMReplica


# -- the agent loop's side ---------------------------------------------------------------------------------

_turns: contextvars.ContextVar = contextvars.ContextVar("gppo_topk_turns", default=None)  # one trajectory's calls


class TopKRecordingClient:
    """verl's LLM server client as the agent loops use it, except that `generate` moves mu's top-K (and,
    where the client records them, the weight version of each token: TOKEN_VERSIONS_FIELD) out of each
    TokenOutput's extra_fields into the running trajectory's list of calls (`_turns`): verl's tool
    agent keeps only the first call's extra_fields."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def generate(self, *args, **kwargs):
        output = await self._client.generate(*args, **kwargs)
        ids = output.extra_fields.pop(TOPK_IDS_FIELD, None)
        logprobs = output.extra_fields.pop(TOPK_LOGPROBS_FIELD, None)
        versions = output.extra_fields.pop(TOKEN_VERSIONS_FIELD, None)
        turns = _turns.get()
        if turns is not None and (ids is not None or versions is not None):
            turns.append((list(output.token_ids), ids, logprobs, versions))
        return output


class TopKRecordingWorker:
    """Over a verl agent-loop worker class: ask the rollout for mu's top-K on training requests (when
    the loss mode reads it), keep each generate call's recording (TopKRecordingClient) and store it
    with each sample (`store_recorded`: the teacher fields, by `teacher_layout`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_top_k = rollout_top_k(self.config)
        self.llm_client = TopKRecordingClient(self.llm_client)

    async def _run_agent_loop(self, sampling_params, trajectory, **kwargs):
        if trajectory["validate"]:
            return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
        if self.rollout_top_k:
            sampling_params = {**sampling_params, TOPK_REQUEST: self.rollout_top_k}
        token = _turns.set([])  # this trajectory's task: verl runs each in its own asyncio task
        try:
            return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
        finally:
            _turns.reset(token)

    async def _compute_teacher_logprobs(self, output, prompt_ids, response_ids, validate, sample_kwargs=None):
        if validate:
            return
        turns = _turns.get()
        if not turns:
            raise gppo.GPPOInputError(
                "the agent loop's generate calls returned no rollout top-K: an agent loop must call "
                "server_manager.generate with its sampling_params unchanged (verl's single_turn_agent "
                "and tool_agent do)"
            )
        self.store_recorded(output, prompt_ids, response_ids, turns)

    def store_recorded(self, output, prompt_ids, response_ids, turns) -> None:
        """Put the trajectory's recording in the sample's extra_fields: mu's top-K as verl's teacher fields."""
        output.extra_fields[TOPK_IDS_KEY], output.extra_fields[TOPK_LOGPROBS_KEY] = teacher_layout(
            len(prompt_ids), response_ids, output.response_mask, turns
        )


class TopKAgentLoopWorkerClass(TopKRecordingWorker, AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's v1 agent-loop worker that records mu's top-K (TopKRecordingWorker)."""


# The actors are made with ray.remote(cls), the classes kept under names of their own: Ray's pickler
# sends a class by reference only when its module attribute is the class itself, and by value
# otherwise, with the globals its methods read (this module's ContextVar cannot be pickled).
TopKAgentLoopWorker = ray.remote(TopKAgentLoopWorkerClass)


class TopKAgentLoopManager(AgentLoopManagerTQ):
    """verl's v1 agent-loop manager with TopKAgentLoopWorker workers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = TopKAgentLoopWorker


# -- the trainer's side ------------------------------------------------------------------------------------


def flag_topk_updates(group) -> None:
    """Make the actor worker group's update_actor flag each batch `distillation_use_topk`: verl's FSDP
    engine then calls the loss function (topk_ppo_loss) on the logits first, to gather pi at mu's ids.
    The method is replaced on the group itself (verl binds its worker methods there), so the group
    keeps its identity wherever verl compares it (a hybrid engine's reference shares it). The v1
    trainer hands it a batch with `extra_info`; RayPPOTrainer._update_actor (which the fully-async
    trainer runs) a TensorDict, whose non-tensor field it is."""
    update = group.update_actor

    def update_actor(batch):
        if isinstance(batch, TensorDict):
            tu.assign_non_tensor(batch, distillation_use_topk=True)
        else:
            batch.extra_info["distillation_use_topk"] = True
        return update(batch)

    group.update_actor = update_actor


def topk_trainer(base: type) -> type:
    """A verl v1 trainer class whose actor trains with topk_ppo_loss on the rollout's top-K."""

    class TopKTrainer(base):
        def init(self):
            super().init()
            actor = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.actor_rollout_wg.set_loss_fn(partial(topk_ppo_loss, config=actor))
            flag_topk_updates(self.actor_rollout_wg)

    TopKTrainer.__name__ = TopKTrainer.__qualname__ = f"TopK{base.__name__}"
    return TopKTrainer


def install_topk_replica() -> None:
    """In this process, make verl build vLLM replicas that record mu's top-K on request."""
    RolloutReplicaRegistry.register("vllm", _load_topk_replica)


def install(config: DictConfig) -> None:
    """In this process (the task runner's), make verl build vLLM replicas that record mu's top-K and
    the trainer of `trainer.v1.trainer_mode` with the top-K loss."""
    install_topk_replica()
    mode = config.trainer.v1.trainer_mode
    TRAINER_REGISTRY[mode] = topk_trainer(get_trainer_cls(mode))


class TopKTaskRunnerClass(TaskRunnerV1.__ray_actor_class__):
    """verl's v1 task runner, with the top-K pieces installed in its process first."""

    def run(self, config: DictConfig):
        install(config)
        return super().run(config)


TopKTaskRunner = ray.remote(TopKTaskRunnerClass)


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    """verl's main_ppo (same config, same overrides), with mu's top-K recorded at rollout when the
    gppo loss mode needs it; otherwise verl's main_ppo itself."""
    if not prepare_config(config):
        return verl_main.__wrapped__(config)  # the function under verl's own hydra.main
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TopKTaskRunner)


if __name__ == "__main__":
    # through the module's import name, so that the classes Ray and verl's FQN settings name (the task
    # runner, the agent-loop manager) resolve in the other processes, which cannot import __main__'s
    from gppo.integrations import verl_topk

    verl_topk.main()
