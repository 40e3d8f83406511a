"""The rollout side of the top-K estimators in verl (gppo.integrations.verl_topk), against verl 0.9.1's
own classes where they run on CPU.

- Config: `prepare_config` on the composed example config sets the run up (K from the preset, the
  agent-loop manager, topk_source) so that verl's own validate_config passes, leaves other modes
  alone and refuses each setting the rollout side cannot serve; verl's LoRA settings pass through
  it untouched, into the model config verl's FSDP engine and vLLM server read.
- Multi-turn: verl's own ToolAgentLoop with a Python tool over a scripted server puts each turn's
  top-K at that turn's generated tokens and zeros at tool tokens; the loss with that layout equals
  the loss with the tool tokens cut out.
- Agent loop: `TopKAgentLoopWorker` on verl's AgentLoopOutput; its teacher fields, padded by verl's
  own `_pad_teacher_outputs`, equal the [B, S, K] batch that tests/test_verl_engine.py trains
  through verl's FSDP engine and checks against gppo.policy_loss (so the chain's layout is the
  one proven there).
- Trainer: verl's real `PPOTrainerSync._update_actor` under `topk_trainer` hands the actor an update
  flagged distillation_use_topk; `init` sets topk_ppo_loss as the actor's loss function; `install`
  registers the replica and the trainer.
- Launcher: `main` takes main_ppo's arguments; a top-K mode runs with TopKTaskRunner, another goes to
  verl's main_ppo itself.
The server side is in tests/test_vllm_topk.py (stand-ins) and tests/test_verl_vllm_server.py (verl's
server on vLLM's CPU build).
"""

from __future__ import annotations

import asyncio
from collections import namedtuple

import pytest
import torch

for _module in ("verl", "hydra", "transfer_queue", "torchdata"):  # verl's v1 trainer imports the last two
    pytest.importorskip(_module)

from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402

import gppo  # noqa: E402
from gppo.integrations import verl_topk, vllm_topk  # noqa: E402
from gppo.integrations.verl import TOPK_IDS_KEY, TOPK_LOGPROBS_KEY, topk_ppo_loss  # noqa: E402
from tests.conftest import VERL_CONFIG_DIR  # noqa: E402
from tests.conftest import compose_verl_example as compose_example  # noqa: E402

CONFIG_DIR = str(VERL_CONFIG_DIR)


TOPK_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode=gppo_dppo_topk_kl"
VLLM = "actor_rollout_ref.rollout.name=vllm"


# ---- config ----


def micro_topk_config(micro_model, *overrides):
    """The composed example config of a top-K run of the micro model, as verl validates it."""
    return compose_example(
        VLLM,
        TOPK_MODE,
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={micro_model}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        *overrides,
    )


def test_prepare_config_sets_a_topk_run_up_that_verl_validates(micro_model):
    cfg = micro_topk_config(micro_model)
    assert verl_topk.prepare_config(cfg) == gppo.preset("dppo-topk-kl").top_k == 20
    assert cfg.actor_rollout_ref.actor.policy_loss.topk_source == "batch"
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == (
        "gppo.integrations.verl_topk.TopKAgentLoopManager"
    )
    assert "max_logprobs" not in cfg.actor_rollout_ref.rollout.engine_kwargs.vllm  # vLLM's default 20 suffices
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))

    cfg = compose_example(VLLM, TOPK_MODE, "actor_rollout_ref.actor.policy_loss.top_k=32")
    assert verl_topk.prepare_config(cfg) == 32
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 32


LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=all-linear",
)


def lora_topk_config(micro_model, *overrides):
    """The composed example config of a top-K run with verl's LoRA settings, set up by prepare_config."""
    cfg = micro_topk_config(micro_model, *LORA, *overrides)
    model = str(cfg.actor_rollout_ref.model)
    assert verl_topk.prepare_config(cfg) == 20
    assert str(cfg.actor_rollout_ref.model) == model  # the LoRA settings as given
    assert cfg.actor_rollout_ref.actor.policy_loss.topk_source == "batch"
    return cfg


@pytest.mark.parametrize("merge", [False, True])
def test_prepare_config_keeps_verl_lora_settings(micro_model, merge):
    """With LoRA (the adapter synced to vLLM, or lora.merge=true: merged weights) the top-K run is set
    up as without it, and the ModelConfig that verl's workers build carries the settings. verl's
    validate_config passes with merge=true; with merge=false it also checks the rank against vLLM's
    LoRA ranks, importing vLLM, which this environment lacks (tests/test_verl_vllm_server.py runs it)."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = lora_topk_config(micro_model, f"actor_rollout_ref.model.lora.merge={merge}")
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    assert (model_config.lora_rank, model_config.lora_alpha, model_config.target_modules) == (8, 32, "all-linear")
    assert model_config.lora["merge"] is merge
    if merge:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_prepare_config_leaves_modes_without_topk_alone():
    for overrides in [
        (),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gppo_dppo_binary_tv",),
        (
            "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        ),
    ]:
        cfg = compose_example(*overrides)
        before = str(cfg)
        assert verl_topk.prepare_config(cfg) == 0
        assert str(cfg) == before


@pytest.mark.parametrize(
    "override, field",
    [
        ("trainer.use_v1=false", "trainer.use_v1"),
        ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name='sglang'"),
        ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.logprobs_mode"),
        ("actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_p=0.9"),
        ("actor_rollout_ref.rollout.top_k=50", "actor_rollout_ref.rollout.top_k=50"),
        ("distillation.enabled=true", "distillation.enabled"),
        (
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=my.Manager",
            "agent_loop_manager_class='my.Manager'",
        ),
        ("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=10", "max_logprobs=10"),
    ],
)
def test_prepare_config_refuses_what_the_rollout_side_cannot_serve(override, field):
    cfg = compose_example(VLLM, TOPK_MODE, override)
    with pytest.raises(gppo.GPPOConfigError, match=field.replace(".", r"\.")):
        verl_topk.prepare_config(cfg)


# ---- the agent loop's side ----


def agent_loop_worker(config):
    """A TopKAgentLoopWorker without its Ray actor and TransferQueue client (only the methods under test)."""
    worker_class = verl_topk.TopKAgentLoopWorker.__ray_actor_class__
    worker = worker_class.__new__(worker_class)
    worker.config = config
    worker.rollout_top_k = verl_topk.rollout_top_k(config)
    return worker


def agent_loop_output(prompt_ids, response_ids, response_mask=None):
    return AgentLoopOutput(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=response_mask or [1] * len(response_ids),
        metrics=AgentLoopMetrics(),
        extra_fields={"turn_scores": []},
    )


def teacher_fields(worker, output, turns, validate=False):
    """worker._compute_teacher_logprobs on `output` inside a trajectory whose generate calls were `turns`."""

    async def run():
        verl_topk._turns.set(turns)
        await worker._compute_teacher_logprobs(output, output.prompt_ids, output.response_ids, validate=validate)

    asyncio.run(run())


def test_agent_loop_fields_padded_by_verl_equal_the_batch_the_engine_test_trains(micro_model):
    from verl.experimental.teacher_loop.teacher_manager import _pad_teacher_outputs

    from tests.test_verl_engine import PROMPT_LEN, RESPONSE_LEN, make_batch

    batch = make_batch(micro_model)
    worker = agent_loop_worker(compose_example(VLLM, TOPK_MODE))
    rows_ids, rows_logp = [], []
    for i in range(len(batch["prompts"])):
        prompt_mask, response_mask = batch["attention_mask"][i, :PROMPT_LEN].bool(), batch["response_mask"][i].bool()
        prompt, response = batch["prompts"][i][prompt_mask].tolist(), batch["responses"][i][response_mask].tolist()
        length = len(response)
        output = agent_loop_output(prompt, response)
        turn = (response, batch["mu_topk_ids"][i, :length].tolist(), batch["mu_topk_logp"][i, :length].tolist())
        teacher_fields(worker, output, [turn])
        fields = output.as_dict()  # verl's: moves the teacher fields out of extra_fields
        ids, logp = _pad_teacher_outputs(
            fields[TOPK_IDS_KEY],
            fields[TOPK_LOGPROBS_KEY],
            prompt_width=PROMPT_LEN,
            response_width=RESPONSE_LEN,
            prompt_length=len(prompt),
            response_length=length,
            pad_token_id=0,
        )
        rows_ids.append(ids)
        rows_logp.append(logp)
    assert torch.equal(torch.cat(rows_ids).long(), batch[TOPK_IDS_KEY])
    assert torch.equal(torch.cat(rows_logp), batch[TOPK_LOGPROBS_KEY])


def test_agent_loop_asks_for_topk_on_training_requests_only(monkeypatch):
    seen = []

    async def base_run(self, sampling_params, trajectory, **kwargs):
        seen.append(sampling_params)

    monkeypatch.setattr(verl_topk.AgentLoopWorkerTQ.__ray_actor_class__, "_run_agent_loop", base_run)
    worker = agent_loop_worker(compose_example(VLLM, TOPK_MODE, "actor_rollout_ref.actor.policy_loss.top_k=7"))
    params = {"temperature": 1.0, "logprobs": True}
    for validate in (False, True):
        asyncio.run(worker._run_agent_loop(params, {"validate": validate}, agent_name="single_turn_agent"))
    assert seen == [{**params, vllm_topk.TOPK_REQUEST: 7}, params]

    output = agent_loop_output([5, 6], [7])
    teacher_fields(worker, output, [([7], [[1, 2]], [[-0.1, -0.2]])], validate=True)
    assert set(output.extra_fields) == {"turn_scores"}  # validation stores no top-K


def test_agent_loop_refuses_responses_without_a_topk_per_token():
    worker = agent_loop_worker(compose_example(VLLM, TOPK_MODE))
    resumed = agent_loop_output([5], [7, 8])  # one response from two calls (a request resumed after an abort)
    with pytest.raises(gppo.GPPOInputError, match="partial"):
        teacher_fields(worker, resumed, [([7], [[1]], [[-0.1]]), ([8], [[1]], [[-0.1]])])
    short = agent_loop_output([5], [7, 8])
    with pytest.raises(gppo.GPPOInputError, match="top-K for 1 tokens of a 2-token generate call"):
        teacher_fields(worker, short, [([7, 8], [[1]], [[-0.1]])])
    with pytest.raises(gppo.GPPOInputError, match="sampling_params"):
        teacher_fields(worker, agent_loop_output([5], [7]), [])


# ---- multi-turn: verl's tool agent loop ----

CHATML = (  # a ChatML template with hermes tool calls (verl's default multi_turn.format)
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with CHATML: any text, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {c: i for i, c in enumerate(sorted(byte_chars) + special)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=special
    )
    tokenizer.chat_template = CHATML
    return tokenizer


class ScriptedServer:
    """verl's LLM server client as an agent loop calls it: the c-th call returns the tokens of
    replies[c] and, when asked (TOPK_REQUEST = K), a top-K that names the call and position
    (ids 1000 c + 10 t + j, log-probs -ids / 1e4); it keeps each call's prompt."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    def topk(self, call, length, k):
        ids = [[1000 * call + 10 * t + j for j in range(k)] for t in range(length)]
        return ids, [[-i / 1e4 for i in row] for row in ids]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        call = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        tokens = self.tokenizer.encode(self.replies[call], add_special_tokens=False)
        tokens.append(self.tokenizer.eos_token_id)
        extra = {}
        if sampling_params.get(vllm_topk.TOPK_REQUEST):
            ids, logprobs = self.topk(call, len(tokens), sampling_params[vllm_topk.TOPK_REQUEST])
            extra = {vllm_topk.TOPK_IDS_FIELD: ids, vllm_topk.TOPK_LOGPROBS_FIELD: logprobs}
        return TokenOutput(token_ids=tokens, log_probs=[-0.5] * len(tokens), extra_fields=extra)


def tool_call(code):
    return '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'


def test_tool_agent_loop_topk_lands_at_each_turns_generated_tokens(monkeypatch):
    """verl's ToolAgentLoop with the Python tool (tests/verl_python_tool.py) over a scripted server,
    three assistant turns around two tool results, through TopKAgentLoopWorker: each turn's top-K sits
    at the tokens that turn generated, found from the server's side (call c's tokens follow its
    prompt, as the context only grows), zeros at tool tokens; the tool really ran."""
    from pathlib import Path

    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.tools.tool_registry import load_all_tools

    k = 3
    cfg = compose_example(
        VLLM,
        TOPK_MODE,
        f"actor_rollout_ref.actor.policy_loss.top_k={k}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={Path(__file__).parent / 'verl_python_tool.py'}",
        "data.max_prompt_length=1024",
        "data.max_response_length=1024",
    )
    assert verl_topk.prepare_config(cfg) == k  # the launcher's config check accepts multi_turn with a tool
    tokenizer = byte_tokenizer()
    server = ScriptedServer(tokenizer, [tool_call("print(6 * 7)"), tool_call("print(2 ** 10)"), "It is 42."])
    worker = agent_loop_worker(cfg)
    worker.llm_client = verl_topk.TopKRecordingClient(server)
    tools = load_all_tools(None, cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path)

    async def base_run(self, sampling_params, trajectory, **kwargs):  # verl's, without padding and scoring
        loop = ToolAgentLoop(
            trainer_config=DictConfigWrap(cfg),
            server_manager=self.llm_client,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(cfg.data),
            tools=ToolListWrap(tools),
        )
        output = await loop.run(sampling_params, raw_prompt=[{"role": "user", "content": "6 * 7?"}])
        await self._compute_teacher_logprobs(output, output.prompt_ids, output.response_ids, validate=False)
        return output

    monkeypatch.setattr(verl_topk.AgentLoopWorkerTQ.__ray_actor_class__, "_run_agent_loop", base_run)
    output = asyncio.run(worker._run_agent_loop({"temperature": 1.0}, {"validate": False}))

    assert len(server.prompts) == 3
    prompt_len, mask = len(output.prompt_ids), torch.tensor(output.response_mask)
    sequence = output.prompt_ids + output.response_ids
    expected_ids = torch.zeros(len(sequence), k, dtype=torch.int32)
    expected_logp = torch.zeros(len(sequence), k)
    generated = torch.zeros(len(sequence), dtype=torch.bool)
    for call, prompt in enumerate(server.prompts):
        assert sequence[: len(prompt)] == prompt
        tokens = tokenizer.encode(server.replies[call], add_special_tokens=False) + [tokenizer.eos_token_id]
        at = slice(len(prompt), len(prompt) + len(tokens))
        assert sequence[at] == tokens
        generated[at] = True
        ids, logp = server.topk(call, len(tokens), k)
        expected_ids[len(prompt) - 1 : at.stop - 1] = torch.tensor(ids, dtype=torch.int32)
        expected_logp[len(prompt) - 1 : at.stop - 1] = torch.tensor(logp)
    assert torch.equal(generated[prompt_len:], mask.bool())  # verl's mask: 1 exactly at the generated tokens
    assert 0 < mask.sum() < len(mask)
    fields = output.as_dict()
    assert torch.equal(fields[TOPK_IDS_KEY], expected_ids)
    assert torch.equal(fields[TOPK_LOGPROBS_KEY], expected_logp)
    tool_rows = prompt_len - 1 + torch.nonzero(mask == 0).squeeze(1)  # entries predicting tool tokens
    assert not fields[TOPK_IDS_KEY][tool_rows].any() and not fields[TOPK_LOGPROBS_KEY][tool_rows].any()
    assert vllm_topk.TOPK_IDS_FIELD not in fields["extra_fields"]
    tool_text = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if not m])
    assert "42" in tool_text and "1024" in tool_text  # the tool's outputs, from the sandbox


def test_loss_ignores_tool_tokens_and_their_zero_topk():
    """compute_policy_loss_gppo with mu's top-K (as topk_ppo_loss feeds it) on a response with a tool
    segment laid out by teacher_layout (zeros, and arbitrary pi / advantages there) equals the loss and
    metrics of the same response with the tool tokens cut out: every reduction, the top-K
    estimator's included, goes through verl's response_mask."""
    from verl.utils.config import omega_conf_to_dataclass

    from gppo.integrations import verl as plugin

    cfg = compose_example(VLLM, TOPK_MODE, "actor_rollout_ref.actor.policy_loss.top_k=4")
    verl_topk.prepare_config(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    gen = torch.Generator().manual_seed(0)
    T, K, V = 12, 4, 50
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1]])
    logits_mu, logits_pi = torch.randn(T, V, generator=gen), torch.randn(T, V, generator=gen) * 0.1
    logits_pi = logits_mu + logits_pi
    mu, pi = logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)
    tokens = torch.randint(0, V, (T,), generator=gen)
    top = mu.topk(K, -1).indices
    fields = {
        "log_prob": pi.gather(-1, tokens[:, None]).T,
        "old_log_prob": mu.gather(-1, tokens[:, None]).T,
        "advantages": torch.randn(1, T, generator=gen),
        "token_ids": tokens[None],
        "topk_ids": top[None],
        "topk_logp_behavior": mu.gather(-1, top)[None],
        "topk_logp": pi.gather(-1, top)[None],
    }
    tool = ~mask[0].bool()
    fields["topk_ids"][0, tool], fields["topk_logp_behavior"][0, tool] = 0, 0.0  # teacher_layout's zeros
    fields["topk_logp"][0, tool] = 0.0

    def loss(fields, mask):
        token = plugin._rollout_topk.set(
            {n: fields[n] for n in ("token_ids", "topk_ids", "topk_logp_behavior", "topk_logp")}
        )
        try:
            return plugin.compute_policy_loss_gppo(
                fields["old_log_prob"], fields["log_prob"], fields["advantages"], mask, "token-mean", actor
            )
        finally:
            plugin._rollout_topk.reset(token)

    kept = mask[0].bool()
    cut = {n: v[:, kept] for n, v in fields.items()}
    full_loss, full_metrics = loss(fields, mask)
    cut_loss, cut_metrics = loss(cut, torch.ones(1, int(kept.sum()), dtype=torch.long))
    torch.testing.assert_close(full_loss, cut_loss)
    assert full_metrics.keys() == cut_metrics.keys()
    for name in full_metrics:
        torch.testing.assert_close(torch.as_tensor(full_metrics[name]), torch.as_tensor(cut_metrics[name]), msg=name)


# ---- the trainer's side ----


class StopAfterUpdate(Exception):
    pass


class RecordingGroup:
    """The actor worker group's two calls the trainer makes here."""

    def __init__(self):
        self.loss_fn, self.extra_info = None, None

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def update_actor(self, batch):
        self.extra_info = dict(batch.extra_info)
        raise StopAfterUpdate


def test_trainer_flags_verl_own_update_and_sets_the_topk_loss():
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cfg = compose_example(VLLM, TOPK_MODE)
    verl_topk.prepare_config(cfg)
    group = RecordingGroup()

    class Initialised(PPOTrainerSync):
        def init(self):  # verl's init builds the worker groups; here only the actor's, recorded
            self.actor_rollout_wg = group

    trainer_cls = verl_topk.topk_trainer(Initialised)
    trainer = trainer_cls.__new__(trainer_cls)
    trainer.config = cfg
    trainer.init()
    assert group.loss_fn.func is topk_ppo_loss
    assert group.loss_fn.keywords["config"].policy_loss.loss_mode == "gppo_dppo_topk_kl"
    assert trainer.actor_rollout_wg is group  # the same group, its update_actor flagged

    batch = namedtuple("Batch", "extra_info")({})
    with pytest.raises(StopAfterUpdate):
        trainer._update_actor(batch, {})  # verl's own, which sets distillation_use_topk=False
    assert group.extra_info["distillation_use_topk"] is True
    assert group.extra_info["distillation_only"] is False


def test_install_registers_the_topk_replica_and_trainer(monkeypatch):
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", dict(RolloutReplicaRegistry._registry))
    monkeypatch.setitem(TRAINER_REGISTRY, "sync", TRAINER_REGISTRY["sync"])
    verl_topk.install(compose_example(VLLM, TOPK_MODE))
    assert RolloutReplicaRegistry._registry["vllm"] is verl_topk._load_topk_replica
    assert issubclass(TRAINER_REGISTRY["sync"], PPOTrainerSync)
    assert TRAINER_REGISTRY["sync"].__name__ == "TopKPPOTrainerSync"


# ---- the launcher ----


@pytest.mark.parametrize("mode, topk", [("gppo_dppo_topk_kl", True), ("gppo_dppo_binary_kl", False)])
def test_launcher_takes_main_ppo_arguments_and_picks_the_task_runner(micro_model, tmp_path, monkeypatch, mode, topk):
    """`python -m gppo.integrations.verl_topk <main_ppo's arguments>`: a top-K mode is prepared,
    validated by verl and run with TopKTaskRunner; another mode goes to verl's main_ppo itself."""
    import sys
    from types import SimpleNamespace

    runs = []

    def run_ppo(config, task_runner_class):
        runs.append((config, task_runner_class))

    monkeypatch.setattr(verl_topk, "run_ppo", run_ppo)
    verl_main = SimpleNamespace(__wrapped__=lambda config: runs.append((config, "verl")))
    monkeypatch.setattr(verl_topk, "verl_main", verl_main)
    monkeypatch.chdir(tmp_path)  # hydra's output folder
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "verl_topk",
            f"--config-dir={CONFIG_DIR}",
            "--config-name=gppo_trainer",
            VLLM,
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
            "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.model.path={micro_model}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        ],
    )
    verl_topk.main()
    ((config, runner),) = runs
    assert runner is (verl_topk.TopKTaskRunner if topk else "verl")
    assert config.actor_rollout_ref.actor.policy_loss.topk_source == ("batch" if topk else None)


def test_a_missing_v1_trainer_dependency_is_named_with_its_install_line():
    import subprocess
    import sys

    code = "import sys; sys.modules['transfer_queue'] = None  # as if not installed\nimport gppo.integrations.verl_topk"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert (
        "ImportError: gppo.integrations.verl_topk extends verl's v1 trainer, which imports 'transfer_queue'"
    ) in out.stderr
    assert "pip install 'verl[verl-core]>=0.9.1,<0.10'" in out.stderr


def test_run_as_a_module_names_classes_other_processes_can_import(micro_model, tmp_path):
    """`python -m gppo.integrations.verl_topk` runs the module as __main__; the agent-loop manager
    that verl loads by name in the task-runner process, and the task runner Ray ships there, must be
    named by the module's import path (a CPU run of main_ppo failed on '__main__.TopKAgentLoopManager')."""
    import subprocess
    import sys

    from verl.utils.import_utils import load_class_from_fqn

    code = f"""
import runpy, sys
import verl.trainer.main_ppo as verl_main_ppo
def run_ppo(config, task_runner_class):
    print("MANAGER", config.actor_rollout_ref.rollout.agent.agent_loop_manager_class)
    print("RUNNER", task_runner_class.__ray_actor_class__.__module__)
verl_main_ppo.run_ppo = run_ppo
sys.argv = ["verl_topk", "--config-dir={CONFIG_DIR}", "--config-name=gppo_trainer", "{VLLM}", "{TOPK_MODE}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path={micro_model}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]
runpy.run_module("gppo.integrations.verl_topk", run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("MANAGER", "RUNNER")))
    assert load_class_from_fqn(lines["MANAGER"], "AgentLoopManager") is verl_topk.TopKAgentLoopManager
    assert lines["RUNNER"] == "gppo.integrations.verl_topk"
