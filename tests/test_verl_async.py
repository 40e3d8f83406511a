"""gppo's policy loss in verl 0.9.1's fully-async trainer (gppo.integrations.verl_async), against verl's
own classes where they run on CPU.

- Staleness: `staleness_metrics` on a batch with verl's min/max_global_steps and the token versions
  equals counts written out by hand.
- Partial rollouts: verl's own FullyAsyncLLMServerClient resume loop (inside VersionedAsyncClient)
  over a scripted server that aborts a request at two weight syncs (versions 0, 1, 2), through verl's
  SingleTurnAgentLoop and AsyncAgentLoopWorker: the joined response carries each part's tokens, the
  version of every token and mu's top-K at the entries that predict them (verl's teacher layout);
  verl's own min/max_global_steps agree with the versions. A server without top-K is refused.
- Trainer: verl's FullyAsyncTrainer.fit_step, unchanged, on RolloutSamples from a scripted message
  queue (verl's assemble_batch_from_rollout_samples, bypass mode: old_log_probs = mu, GRPO
  advantages), under AsyncTrainer: it sets topk_ppo_loss, reports staleness/..., and hands the actor
  a TensorDict flagged distillation_use_topk with mu's top-K. That TensorDict, trained by verl's
  TrainingWorker (FSDP2, gloo, a fresh process; SGD lr 1) with the loss function the trainer set,
  moves the weights by -grad of gppo.policy_loss written on the Hugging Face model
  (tests/test_verl_engine.py's reference) with the advantages verl computed.
- Config and launcher: `prepare_config` sets a top-K run up and refuses what the async run cannot
  serve, naming the setting; `main` takes fully_async_main's arguments and runs AsyncTaskRunner.
The whole run (rollouter, trainer, message queue, 2 parameter syncs) is benchmarks/gpu_check.sh's
verl-async row.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

for _module in ("verl", "hydra", "transfer_queue", "torchdata", "peft", "uvicorn", "fastapi"):
    pytest.importorskip(_module)

from verl import DataProto  # noqa: E402

import gppo  # noqa: E402
from gppo.integrations import verl_async, vllm_topk  # noqa: E402
from gppo.integrations.verl import TOPK_IDS_KEY, TOPK_LOGPROBS_KEY, topk_ppo_loss  # noqa: E402
from gppo.integrations.verl_async import TOKEN_VERSIONS_KEY, staleness_metrics  # noqa: E402
from gppo.integrations.verl_topk import TopKRecordingClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
P = "actor_rollout_ref.actor.policy_loss"
GPPO_LOSS = (
    f"{P}._target_=gppo.integrations.verl.GPPOPolicyLossConfig",
    f"+{P}.bypass_mode=${{algorithm.rollout_correction.bypass_mode}}",
    f"+{P}.use_v1=${{trainer.use_v1}}",
)
TOPK_MODE = f"{P}.loss_mode=gppo_dppo_topk_kl"
VLLM = "actor_rollout_ref.rollout.name=vllm"


def compose_async(*overrides):
    """verl's fully_async_ppo_trainer config with gppo's loss settings, as the launcher composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=verl_async.CONFIG_DIR, version_base=None):
        return compose(
            config_name="fully_async_ppo_trainer",
            overrides=[*GPPO_LOSS, VLLM, "data.train_batch_size=0", *overrides],
        )


# ---- staleness ----


def test_staleness_metrics_count_versions_behind():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0]])
    versions = np.empty(3, dtype=object)
    versions[:] = [[3, 4, 4], [2, -1, 3, 4], [4, 4]]  # -1: a tool token (response_mask 0)
    batch = DataProto.from_dict(
        tensors={"response_mask": mask},
        non_tensors={
            "min_global_steps": np.array([3, 2, 4], dtype=object),
            "max_global_steps": np.array([4, 4, 4], dtype=object),
            TOKEN_VERSIONS_KEY: versions,
        },
    )
    # current version 5; samples' oldest tokens 3, 2, 4 -> 2, 3, 1 behind
    # tokens (mask 1): 2 1 1 | 3 2 1 | 1 1 -> mean 12 / 8; distinct versions per sample 2, 3, 1
    assert staleness_metrics(5, batch) == {
        "staleness/sample_min": 1.0,
        "staleness/sample_mean": 2.0,
        "staleness/sample_max": 3.0,
        "staleness/token_min": 1.0,
        "staleness/token_mean": 1.5,
        "staleness/token_max": 3.0,
        "staleness/versions_per_completion_mean": 2.0,
        "staleness/versions_per_completion_max": 3.0,
    }


# ---- partial rollouts: verl's resume loop ----


class Remote:
    """A Ray actor handle stand-in: each method `m` of `target` as `handle.m.remote(...)`."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)
        return type("Method", (), {"remote": staticmethod(method)})


class AbortingServer:
    """verl's vLLM server as the client reaches it: each call generates from where the request stands
    and, until the last part, is aborted by a weight sync after `parts[c]` tokens; the c-th call runs on
    weight version c. Token t of the response is 100 + t; with TOPK_REQUEST = K its top-K ids are
    1000 t + j (log-probs -ids / 1e4), or none when `topk` is False."""

    def __init__(self, parts, topk=True):
        self.parts, self.topk, self.calls = parts, topk, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        call = len(self.calls)
        self.calls.append((list(prompt_ids), dict(sampling_params)))
        done = len(prompt_ids) - len(self.calls[0][0])
        tokens = [100 + done + t for t in range(self.parts[call])]
        extra = {"global_steps": call}
        k = sampling_params.get(vllm_topk.TOPK_REQUEST)
        if k and self.topk:
            ids = [[1000 * (done + t) + j for j in range(k)] for t in range(len(tokens))]
            extra[vllm_topk.TOPK_IDS_FIELD] = ids
            extra[vllm_topk.TOPK_LOGPROBS_FIELD] = [[-i / 1e4 for i in row] for row in ids]
        last = call == len(self.parts) - 1
        return TokenOutput(
            token_ids=tokens,
            log_probs=[-0.1 * (done + t) for t in range(len(tokens))],
            stop_reason="stop" if last else "aborted",
            extra_fields=extra,
        )


class Balancer:
    """verl's global load balancer as the client calls it: one server."""

    def __init__(self, server):
        self.server = Remote(server)

    async def require_acquire_fields(self):
        return []

    async def require_release_fields(self):
        return []

    async def acquire_server(self, request_id, **fields):
        return "0", self.server

    def release_server(self, server_id, **fields):
        pass


def async_worker(config):
    """An AsyncAgentLoopWorker without its Ray actor (the methods under test)."""
    worker_class = verl_async.AsyncAgentLoopWorker.__ray_actor_class__
    worker = worker_class.__new__(worker_class)
    worker.config = config
    worker.rollout_top_k = verl_async.rollout_top_k(config)
    return worker


def run_partial_rollout(config, server, prompt_ids):
    """One training trajectory of verl's SingleTurnAgentLoop through `worker` over VersionedAsyncClient
    on `server`: the agent loop's output with the worker's recorded fields."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from tests.test_verl_topk import byte_tokenizer

    tokenizer = byte_tokenizer()
    worker = async_worker(config)
    client = verl_async.VersionedAsyncClient(config=config, load_balancer_handle=Remote(Balancer(server)))
    worker.llm_client = TopKRecordingClient(client)

    async def base_run(self, sampling_params, trajectory, **kwargs):  # verl's, without padding and scoring
        loop = SingleTurnAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=self.llm_client,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(config.data),
        )
        loop.ct_build_initial_tokens = _fixed_prompt(prompt_ids)
        output = await loop.run(sampling_params, raw_prompt=[{"role": "user", "content": "1 + 1?"}])
        await self._compute_teacher_logprobs(output, output.prompt_ids, output.response_ids, validate=False)
        return output

    original = AgentLoopWorker._run_agent_loop
    AgentLoopWorker._run_agent_loop = base_run
    try:
        return asyncio.run(worker._run_agent_loop({"temperature": 1.0, "logprobs": True}, {"validate": False}))
    finally:
        AgentLoopWorker._run_agent_loop = original


def _fixed_prompt(prompt_ids):
    async def build_initial_tokens(*args, **kwargs):
        return list(prompt_ids)

    return build_initial_tokens


def test_partial_rollout_parts_join_into_one_call_with_versions_and_topk(monkeypatch):
    import verl.workers.rollout.llm_server as llm_server

    async def no_wait(seconds):  # verl waits 1 s before resuming an aborted request
        pass

    monkeypatch.setattr(llm_server.asyncio, "sleep", no_wait)
    k, parts, prompt = 3, [3, 2, 4], [7, 8, 9, 10]
    config = compose_async(TOPK_MODE, f"+{P}.top_k={k}", "data.max_response_length=9")
    assert verl_async.prepare_config(config) == k
    server = AbortingServer(parts)
    output = run_partial_rollout(config, server, prompt)

    length = sum(parts)
    assert [len(p) - len(prompt) for p, _ in server.calls] == [0, 3, 5]  # each resume sends what stands
    assert all(params[vllm_topk.TOPK_REQUEST] == k for _, params in server.calls)
    assert output.response_ids == [100 + t for t in range(length)]
    assert output.response_logprobs == pytest.approx([-0.1 * t for t in range(length)])
    assert output.extra_fields[TOKEN_VERSIONS_KEY] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"]) == (0, 2)  # verl's
    fields = output.as_dict()
    ids, logp = fields[TOPK_IDS_KEY], fields[TOPK_LOGPROBS_KEY]
    assert ids.shape == (len(prompt) + length, k)
    expected = torch.tensor([[1000 * t + j for j in range(k)] for t in range(length)], dtype=torch.int32)
    assert torch.equal(ids[len(prompt) - 1 : -1], expected)  # entry p predicts token p + 1
    assert torch.equal(logp[len(prompt) - 1 : -1], -expected.float() / 1e4)
    assert not ids[: len(prompt) - 1].any() and not ids[-1].any()
    assert vllm_topk.TOPK_IDS_FIELD not in fields["extra_fields"]

    # a mode without top-K: versions only, no top-K asked for or stored
    plain = compose_async(f"{P}.loss_mode=gppo_dppo_binary_kl", "data.max_response_length=9")
    server = AbortingServer(parts)
    output = run_partial_rollout(plain, server, prompt)
    assert all(vllm_topk.TOPK_REQUEST not in params for _, params in server.calls)
    assert output.extra_fields[TOKEN_VERSIONS_KEY] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert TOPK_IDS_KEY not in output.as_dict()


def test_a_server_that_records_no_topk_is_refused(monkeypatch):
    import verl.workers.rollout.llm_server as llm_server

    async def no_wait(seconds):
        pass

    monkeypatch.setattr(llm_server.asyncio, "sleep", no_wait)
    config = compose_async(TOPK_MODE, "data.max_response_length=9")
    verl_async.prepare_config(config)
    with pytest.raises(gppo.GPPOInputError, match="TopKvLLMHttpServer"):
        run_partial_rollout(config, AbortingServer([3, 6], topk=False), [7, 8])


# ---- the trainer: verl's FullyAsyncTrainer.fit_step ----


class StopAfterUpdate(Exception):
    pass


class RecordingGroup:
    """The actor worker group as the trainer calls it here: the loss function it sets and the first
    update's TensorDict."""

    world_size = 1

    def __init__(self):
        self.loss_fn, self.batch = None, None

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def update_actor(self, batch):
        self.batch = batch
        raise StopAfterUpdate


class ScriptedQueue:
    """verl's message-queue client as the trainer reads it: pickled RolloutSamples, then None."""

    def __init__(self, samples):
        import ray

        self.samples = [ray.cloudpickle.dumps(s) for s in samples]

    async def get_sample(self):
        return (self.samples.pop(0) if self.samples else None), len(self.samples)


GROUP = 2  # rollout.n: responses per prompt (one RolloutSample)
VERSIONS = [(3, 3), (2, 3), (3, 3), (1, 2)]  # (min, max) global_steps per RolloutSample; trainer at 3


def rollout_samples(batch):
    """make_batch's 8 sequences as 4 RolloutSamples of GROUP responses, as the rollouter queues them
    (verl's agent-loop fields; a sample spanning two versions switched at its third token)."""
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample

    from tests.test_verl_engine import RESPONSE_LEN

    samples = []
    for s, (low, high) in enumerate(VERSIONS):
        rows = slice(GROUP * s, GROUP * (s + 1))
        response_mask = batch["response_mask"][rows]
        scores = torch.zeros(GROUP, RESPONSE_LEN)
        last = response_mask.sum(1).long() - 1
        scores[torch.arange(GROUP), last] = torch.tensor([1.0, 0.0]) if s % 2 else torch.tensor([0.0, 1.0])
        versions = np.empty(GROUP, dtype=object)
        versions[:] = [[low] * 2 + [high] * (int(n) - 2) for n in response_mask.sum(1)]
        full_batch = DataProto.from_dict(
            tensors={
                **{k: batch[k][rows] for k in ("prompts", "responses", "input_ids", "attention_mask", "position_ids")},
                "response_mask": response_mask.long(),
                "rollout_log_probs": batch["old_log_probs"][rows],
                "rm_scores": scores,
                TOPK_IDS_KEY: batch[TOPK_IDS_KEY][rows],
                TOPK_LOGPROBS_KEY: batch[TOPK_LOGPROBS_KEY][rows],
            },
            non_tensors={
                "uid": np.array([f"uid_{s}"] * GROUP, dtype=object),
                "min_global_steps": np.array([low] * GROUP, dtype=object),
                "max_global_steps": np.array([high] * GROUP, dtype=object),
                TOKEN_VERSIONS_KEY: versions,
            },
            meta_info={"metrics": [{"generate_sequences": 0.1, "tool_calls": 0.0}] * GROUP},
        )
        samples.append(RolloutSample(full_batch=full_batch, sample_id=f"sample_{s}", epoch=0, rollout_status={}))
    return samples


def trainer_config(model_dir):
    from tests.test_verl_engine import DPPO_FIELDS, MICRO_BATCH

    actor = "actor_rollout_ref.actor"
    return compose_async(
        TOPK_MODE,
        *(f"+{P}.{k}={v}" for k, v in DPPO_FIELDS.items()),
        f"actor_rollout_ref.model.path={model_dir}",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={GROUP}",
        f"{actor}.ppo_mini_batch_size={len(VERSIONS)}",
        f"{actor}.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"{actor}.entropy_coeff=0",
        f"{actor}.use_kl_loss=false",
        "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1",
        "actor_rollout_ref.hybrid_engine=false",
        "trainer.balance_batch=false",
        "trainer.logger=[console]",
        "trainer.test_freq=-1",
    )


def test_fully_async_trainer_step_hands_the_actor_the_topk_batch_and_staleness(micro_model, tmp_path):
    """fit_step up to the actor update; then the recorded update trained through verl's engine."""
    from transformers import AutoTokenizer
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer

    from tests.test_verl_engine import PROMPT_LEN, make_batch

    config = trainer_config(micro_model)
    assert verl_async.prepare_config(config) == 20
    batch = make_batch(micro_model)
    group = RecordingGroup()

    async def init_workers(self):  # verl's builds the worker groups; here only the actor's, recorded
        self.actor_wg = self.actor_rollout_wg = group

    base = FullyAsyncTrainer.__ray_actor_class__
    original, base.init_workers = base.init_workers, init_workers
    try:
        padded = []

        class Trainer(verl_async.AsyncTrainer.__ray_actor_class__):
            def _update_actor(self, batch):  # the padded batch verl's update converts, kept for the reference
                padded.append(batch)
                return super()._update_actor(batch)

        tokenizer = AutoTokenizer.from_pretrained(micro_model)
        trainer = Trainer(config, tokenizer, role_worker_mapping={}, resource_pool_manager=None)
        asyncio.run(trainer.init_workers())
    finally:
        base.init_workers = original
    assert group.loss_fn.func is topk_ppo_loss
    trainer.message_queue_client = ScriptedQueue(rollout_samples(batch))
    trainer.rollouter = object()
    trainer.current_param_version = 3
    with pytest.raises(StopAfterUpdate):
        asyncio.run(trainer.fit_step())

    # staleness/...: samples 0, 1, 0, 2 versions behind (oldest tokens); token versions as laid out above
    metrics = trainer.metrics
    assert metrics["staleness/sample_max"] == 2 and metrics["staleness/versions_per_completion_max"] == 2
    assert metrics["staleness/sample_mean"] == pytest.approx(0.75)
    mask = batch["response_mask"].bool()
    behind = torch.tensor([3 - VERSIONS[row // GROUP][0 if t < 2 else 1] for row in range(8) for t in range(10)])
    assert metrics["staleness/token_mean"] == pytest.approx(behind.view(8, 10)[mask].float().mean().item())
    assert metrics["staleness/token_max"] == 2

    update = group.batch
    assert update["distillation_use_topk"] is True  # verl's own _update_actor sets False; the group flags it
    (sent,) = padded
    assert torch.equal(sent.batch["old_log_probs"], batch["old_log_probs"])  # bypass mode: the anchor is mu
    assert torch.equal(sent.batch[TOPK_IDS_KEY], batch[TOPK_IDS_KEY])
    advantages = sent.batch["advantages"]
    assert (advantages[mask] != 0).all()  # GRPO on the scripted scores: both signs
    assert (advantages > 0).any() and (advantages < 0).any()

    # the recorded update through verl's TrainingWorker in a fresh process, with the trainer's loss function
    workdir = tmp_path / "engine"
    workdir.mkdir()
    torch.save({"update": update, "loss_fn": group.loss_fn}, workdir / "update.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "tests.test_verl_async", str(workdir), str(micro_model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    result = torch.load(workdir / "result.pt")
    got = {k: result["after"][k] - result["before"][k] for k in result["before"]}

    from tests.test_verl_engine import max_diff, reference_update, scale

    reference_batch = {**batch, "advantages": advantages, "old_log_probs": sent.batch["old_log_probs"]}
    assert reference_batch["input_ids"].shape[1] == PROMPT_LEN + batch["responses"].shape[1]
    reference = reference_update(micro_model, reference_batch, "gppo_dppo_topk_kl")
    assert set(reference) <= set(got)
    got = {k: got[k] for k in reference}
    assert scale(reference) > 1e-3
    assert max_diff(got, reference) <= 1e-5 * scale(reference), (max_diff(got, reference), scale(reference))
    masked = result["metrics"]["gppo/masked_frac"]
    assert all(0 < m < 1 for m in masked), masked  # the trust region keeps some tokens and drops others


def engine_main(workdir, model_dir):
    """Train the recorded update: verl's TrainingWorker (test_verl_engine's engine settings, SGD lr 1),
    the loss function the trainer set."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from tests import verl_cpu_shim
    from tests.test_verl_engine import MICRO_BATCH, MODES, actor_config, full_weights

    verl_cpu_shim.install()
    torch.set_num_threads(1)
    recorded = torch.load(Path(workdir) / "update.pt", weights_only=False)
    config = actor_config(model_dir, "gppo_dppo_topk_kl", MODES["gppo_dppo_topk_kl"])
    worker_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=config.model_config,
        engine_config=config.engine,
        optimizer_config=config.optim,
        checkpoint_config=config.checkpoint,
    )
    worker_config.engine_config.use_dynamic_bsz = False
    worker_config.engine_config.micro_batch_size_per_gpu = MICRO_BATCH
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(recorded["loss_fn"])
    before = full_weights(worker.engine.module)
    metrics = tu.get(worker.train_mini_batch(recorded["update"]), "metrics")
    metrics = {k: [float(x) for x in v] if isinstance(v, list) else float(v) for k, v in metrics.items()}
    torch.save(
        {"before": before, "after": full_weights(worker.engine.module), "metrics": metrics},
        Path(workdir) / "result.pt",
    )
    torch.distributed.destroy_process_group()


# ---- config and launcher ----


@pytest.mark.parametrize(
    "overrides, match",
    [
        ((f"{P}._target_=verl.workers.config.PolicyLossConfig",), r"policy_loss\._target_='verl"),
        (("actor_rollout_ref.rollout.name=sglang",), r"actor_rollout_ref\.rollout\.name='sglang'"),
        (("actor_rollout_ref.rollout.calculate_log_probs=false",), r"calculate_log_probs=False"),
        (("actor_rollout_ref.rollout.top_p=0.9",), r"actor_rollout_ref\.rollout\.top_p=0\.9"),
        (("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=10",), "max_logprobs=10"),
    ],
)
def test_prepare_config_refuses_what_the_async_run_cannot_serve(overrides, match):
    with pytest.raises(gppo.GPPOConfigError, match=match):
        verl_async.prepare_config(compose_async(TOPK_MODE, *overrides))


def test_prepare_config_leaves_other_modes_alone():
    for overrides in [(f"{P}.loss_mode=gppo_ppo",), (f"{P}._target_=verl.workers.config.PolicyLossConfig",)]:
        config = compose_async(*overrides)
        before = str(config)
        assert verl_async.prepare_config(config) == 0
        assert str(config) == before


def test_launcher_takes_fully_async_arguments_and_runs_the_gppo_task_runner(micro_model, tmp_path, monkeypatch):
    from verl.experimental.fully_async_policy import fully_async_main

    runs = []
    monkeypatch.setattr(
        "verl.trainer.main_ppo.run_ppo", lambda config, task_runner_class: runs.append(task_runner_class)
    )
    monkeypatch.setattr(fully_async_main, "FullyAsyncTaskRunner", fully_async_main.FullyAsyncTaskRunner)
    monkeypatch.chdir(tmp_path)  # hydra's output folder
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "verl_async",
            *GPPO_LOSS,
            VLLM,
            TOPK_MODE,
            "data.train_batch_size=0",
            f"actor_rollout_ref.model.path={micro_model}",
        ],
    )
    verl_async.main()
    assert runs == [verl_async.AsyncTaskRunner]
    assert verl_async.AsyncTaskRunner.__ray_actor_class__.__module__ == "gppo.integrations.verl_async"


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2])
