"""LoRA adapters in gppo's own trainer (`--use_peft`, gppo/models/adapters.py).

Independent references: the base model itself (a fresh adapter has B = 0), the full weight's
gradient (the adapter's gradient is its chain rule: W' = W + s B A gives dL/dB = s dL/dW' A^T and
dL/dA = s B^T dL/dW'), the merged model (W + s B A written into a plain model), an uninterrupted
run (resume is bit-identical), the same files loaded in another dtype by from_pretrained and peft
(rollout copies), and a given adapter loaded on its own (the KL reference).
"""

import copy
import json
import sys

import pytest
import torch

import gppo
from gppo.models.adapters import (
    REFERENCE,
    AdapterError,
    LoraOptions,
    add_adapter,
    linear_layer_names,
    merged_parameters,
    set_adapter_base,
)
from gppo.models.embedded import build_model, build_tokenizer
from gppo.models.forward import policy_outputs
from gppo.models.loading import load_model_and_tokenizer
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.batch import rollout_from_generations, token_batch
from gppo.trainer.rollout_policy import RolloutPolicy
from tests.test_trainer import micro_config

pytest.importorskip("peft", reason='the LoRA tests need peft: pip install "gppo[peft]"')


PPO = gppo.preset("ppo")


def loss_of(model, rollout, config=PPO):
    outputs = policy_outputs(model, rollout, 1.0, config)
    return gppo.policy_loss(token_batch(rollout, outputs), config)[0], outputs


def test_a_fresh_adapter_samples_and_scores_as_the_base(micro_model, tmp_path):
    """B = 0: the first rollout, pi's log-probs and the loss equal the full model's, to float32
    rounding (frozen weights, requires_grad off, take CPU kernels that may round the last bit
    differently); with a KL term the reference is the model with its adapter disabled, which stays
    the base."""
    changes = dict(kl_coef=0.1, reward_funcs=["tests.reward_fns:length_bonus"])  # rewards that vary: weights move
    adapted = Trainer(micro_config(micro_model, tmp_path / "lora", use_peft=True, lora_r=4, **changes))
    full = Trainer(micro_config(micro_model, tmp_path / "full", **changes))
    assert adapted.ref_model is None and full.ref_model is not None
    rollout_a, _ = adapted.rollout(0)
    rollout_f, _ = full.rollout(0)
    assert torch.equal(rollout_a.token_ids, rollout_f.token_ids)
    exact = dict(rtol=0, atol=2e-6)
    torch.testing.assert_close(rollout_a.logp_behavior, rollout_f.logp_behavior, **exact)
    loss_a, out_a = loss_of(adapted.model, rollout_a)
    loss_f, out_f = loss_of(full.model, rollout_f)
    torch.testing.assert_close(out_a.logp, out_f.logp, **exact)
    torch.testing.assert_close(loss_a, loss_f, **exact)

    adapted.train(stop_after=1)
    assert any(p.abs().sum() > 0 for n, p in adapted.model.named_parameters() if "lora_B" in n)  # it trained
    prepared = adapted.prepare(rollout_a)
    base = policy_outputs(full.ref_model, rollout_f, 1.0).logp
    torch.testing.assert_close(prepared.logp_ref, base, rtol=0, atol=1e-6)
    adapted.close()
    full.close()


@pytest.fixture
def adapted_micro():
    """A 2-layer embedded model with an adapter on every linear layer (r 4, alpha 8: s = 2) whose B
    is random, and a rollout sampled from it."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden=32, layers=2, heads=2).float()
    model = add_adapter(model, LoraOptions(r=4, alpha=8.0, dropout=0.0, target_modules=("all-linear",)), seed=0)
    _randomize_lora_b(model, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=1)
    gens = HFEngine(model.eval(), tokenizer).generate(["1+2=", "345+678=", "9+99="], params)
    rollout = rollout_from_generations(gens, torch.linspace(-1, 1, len(gens)), tokenizer.pad_token_id, 0)
    return model, rollout


def lora_layers(model):
    """name -> the peft LoRA layer (its base_layer, lora_A, lora_B and scaling)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def test_the_adapter_gradient_is_the_chain_rule_of_the_full_weight_gradient(adapted_micro):
    model, rollout = adapted_micro
    layers = lora_layers(model)
    assert len(layers) == 2 * 7  # q k v o gate up down per layer
    loss, _ = loss_of(model.train(), rollout)
    loss.backward()

    merged = copy.deepcopy(model).merge_and_unload().train()
    for p in merged.parameters():
        p.requires_grad_(True)
    loss_merged, _ = loss_of(merged, rollout)
    torch.testing.assert_close(loss_merged, loss, rtol=1e-5, atol=1e-7)
    loss_merged.backward()
    merged_weights = dict(merged.named_modules())
    for name, layer in layers.items():
        dW = merged_weights[name.removeprefix("base_model.model.")].weight.grad
        A, B, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        assert s == 2.0
        scale = (dW.abs().max() * s * max(A.abs().max(), B.abs().max())).item()
        torch.testing.assert_close(B.grad, s * dW @ A.detach().T, rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(A.grad, s * B.detach().T @ dW, rtol=1e-4, atol=1e-5 * scale)


def test_merged_weights_give_the_adapted_log_probs(adapted_micro):
    """peft's merge_and_unload (what --merge_lora writes) and gppo's merged_parameters (what vLLM's
    merged sync loads) give base + adapter's log-probs to 1e-5; merged_parameters is W + s B A by hand."""
    model, rollout = adapted_micro
    weights = dict(merged_parameters(model))
    plain = copy.deepcopy(model).merge_and_unload()
    assert weights.keys() == dict(plain.named_parameters()).keys()
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embeddings
    for name, layer in lora_layers(model).items():
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        by_hand = layer.base_layer.weight + layer.scaling["default"] * B @ A
        torch.testing.assert_close(weights[name.removeprefix("base_model.model.") + ".weight"], by_hand)
    mask = rollout.response_mask.bool()
    with torch.no_grad():
        adapted = policy_outputs(model.eval(), rollout, 1.0).logp
        for merged_model in (copy.deepcopy(model).merge_and_unload().eval(), plain.eval()):
            merged = policy_outputs(merged_model, rollout, 1.0).logp
            torch.testing.assert_close(merged[mask], adapted[mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("changes", [{}, dict(off_policy_steps=1, rollout_dtype="bfloat16", kl_coef=0.05)])
def test_lora_checkpoints_hold_the_adapter_and_resume_bit_identically(micro_model, tmp_path, changes):
    """Also off-policy from a bfloat16 rollout copy (refreshed by the adapter alone) with a KL term."""
    changes = dict(changes, use_peft=True, lora_r=4, reward_funcs=["tests.reward_fns:length_bonus"])
    full = Trainer(micro_config(micro_model, tmp_path / "full", merge_lora=True, **changes))
    full.train()
    interrupted = Trainer(micro_config(micro_model, tmp_path / "resumed", **changes))
    assert interrupted.train(stop_after=1) is None
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_000001"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    adapter = [p for p in interrupted.model.parameters() if p.requires_grad]
    assert len(state) == len(adapter) == 2 * 7  # AdamW's moments for A and B of each adapted layer
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(p.numel() for p in adapter)
    resumed = Trainer.resume(tmp_path / "resumed", {"progress": False})
    resumed.train()
    # the uninterrupted run's model was merged in place at its end (merge_lora): compare with its final/
    for (name, a), b in zip(resumed.model.named_parameters(), final_parameters(tmp_path / "full")):
        assert torch.equal(a, b), name
    if resumed.rollout_policy.is_copy:  # the bfloat16 copy holds the trained adapter
        for p, q in zip(resumed.model.parameters(), resumed.rollout_policy.model.parameters()):
            assert torch.equal(p.to(q.dtype), q)

    # final/ loads as base + adapter (the base recorded in adapter_config.json), and merged/ equals it
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["adapter"]["parameters"] == sum(p.numel() for p in adapter)
    assert summary["adapter"]["base_model"] == str(micro_model.resolve())
    final, _ = load_model_and_tokenizer(tmp_path / "full" / "final")
    merged, _ = load_model_and_tokenizer(tmp_path / "full" / "merged")
    rollout, _ = resumed.rollout(1)
    with torch.no_grad():
        a = policy_outputs(final, rollout, 1.0).logp[rollout.response_mask.bool()]
        b = policy_outputs(merged, rollout, 1.0).logp[rollout.response_mask.bool()]
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def final_parameters(run_dir):
    """The parameters of RUN_DIR/final (base + adapter), in named_parameters order."""
    model, _ = load_model_and_tokenizer(run_dir / "final", trainable_adapter=True)
    return [p for _, p in model.named_parameters()]


# ------------------------------------------------------------------------------ bad input
def test_target_names_that_match_no_layer_list_the_models_linear_layers(micro_model, tmp_path):
    model, _ = load_model_and_tokenizer(micro_model)
    names = linear_layer_names(model)
    assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    config = micro_config(micro_model, tmp_path / "a", use_peft=True, lora_target_modules=["q_proj", "qkv"])
    with pytest.raises(AdapterError, match=r"qkv is not among this model's linear layers \(down_proj .* v_proj\)"):
        Trainer(config)
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_use_peft_without_peft_names_the_install_line(micro_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(AdapterError, match=r'--use_peft needs the peft library.*pip install "gppo\[peft\]"'):
        micro_config(micro_model, tmp_path / "a", use_peft=True)


def test_resuming_with_the_other_use_peft_setting_is_refused(micro_model, tmp_path):
    run = Trainer(micro_config(micro_model, tmp_path / "run", use_peft=True, steps=1))
    run.train()
    with pytest.raises(ConfigError, match="holds a LoRA adapter; resume with the run's own setting"):
        Trainer.resume(tmp_path / "run", {"use_peft": False, "steps": 2})


def test_lora_sync_defaults_to_merged_weights_and_needs_vllm(micro_model, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    vllm = micro_config(micro_model, tmp_path / "a", engine="vllm", use_peft=True)
    assert vllm.resolved_lora_sync() == "merged"
    assert (
        micro_config(
            micro_model, tmp_path / "b", engine="vllm", use_peft=True, lora_sync="adapter"
        ).resolved_lora_sync()
        == "adapter"
    )
    assert micro_config(micro_model, tmp_path / "c", use_peft=True).resolved_lora_sync() is None
    with pytest.raises(ConfigError, match="--lora_sync merged would be ignored: it applies with --engine vllm"):
        micro_config(micro_model, tmp_path / "d", use_peft=True, lora_sync="merged")


def test_an_adapter_given_as_model_trains_on_with_use_peft_only(micro_model, tmp_path):
    first = Trainer(micro_config(micro_model, tmp_path / "first", use_peft=True, lora_r=4, steps=1))
    first.train()
    adapter = tmp_path / "first" / "final"
    with pytest.raises(ConfigError, match="is a LoRA adapter: train it further with --use_peft"):
        Trainer(micro_config(adapter, tmp_path / "full"))
    with pytest.raises(ConfigError, match="--lora_r 8 would be ignored: it applies to a new adapter"):
        Trainer(micro_config(adapter, tmp_path / "r8", use_peft=True, lora_r=8))
    again = Trainer(micro_config(adapter, tmp_path / "again", use_peft=True, steps=1))
    trained = {n: p for n, p in again.model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 7 and all(p.shape[0] == 4 or p.shape[1] == 4 for p in trained.values())
    for (name, p), q in zip(again.model.named_parameters(), final_parameters(tmp_path / "first")):
        assert torch.equal(p, q), name  # it starts from the given adapter
    again.close()


def adapter_gradient(model, rollout, options):
    model.zero_grad(set_to_none=True)
    outputs = policy_outputs(model.train(), rollout, 1.0, PPO, options=options)
    gppo.policy_loss(token_batch(rollout, outputs), PPO)[0].backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def test_checkpointing_and_bf16_autocast_run_through_the_adapter(adapted_micro):
    """The forward's options through a peft-wrapped model: activation checkpointing (without prompt
    sharing) gives the shared-prompt adapter gradient to float32 rounding; bfloat16 autocast gives
    it to bf16 precision (cosine > 0.99), while the adapter and its gradient stay float32."""
    from gppo.models.forward import ForwardOptions, drops_cache_in_backward, enable_activation_checkpointing

    model, rollout = adapted_micro
    reference = adapter_gradient(model, rollout, ForwardOptions())
    bf16 = adapter_gradient(model, rollout, ForwardOptions(autocast=torch.bfloat16))
    assert bf16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(bf16, reference, dim=0) > 0.99
    enable_activation_checkpointing(model)
    assert drops_cache_in_backward(model.train())  # checkpointing reached the decoder layers inside peft
    checkpointed = adapter_gradient(model, rollout, ForwardOptions(share_prompt=False))
    torch.testing.assert_close(checkpointed, reference, rtol=1e-4, atol=1e-6 * reference.abs().max().item())


# ------------------------------------------------------------------------------ rollout copy
@pytest.fixture
def saved_adapter(micro_model, tmp_path):
    """An adapter directory on the micro model (r 4, alpha 8, every linear layer, B random: its
    policy is not the base's), its base recorded in adapter_config.json."""
    model, _ = load_model_and_tokenizer(micro_model)
    model = add_adapter(model, LoraOptions(r=4, alpha=8.0, dropout=0.0, target_modules=("all-linear",)), seed=0)
    _randomize_lora_b(model, seed=2)
    set_adapter_base(model, micro_model)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def samples(model, tokenizer):
    """(tokens, log-probs) of 4 completions of 3 prompts sampled by the hf engine, seed fixed."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=3)
    return [
        (g.completion_ids, g.logprobs)
        for g in HFEngine(model, tokenizer).generate(["1+2=", "345+678=", "9+99="], params)
    ]


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_a_rollout_copy_in_the_training_dtype_samples_exactly_as_the_model(adapted, micro_model, saved_adapter):
    model, tokenizer = load_model_and_tokenizer(saved_adapter if adapted else micro_model, trainable_adapter=True)
    copy = RolloutPolicy(model, torch.float32, separate=True).model
    assert copy is not model
    assert samples(copy, tokenizer) == samples(model, tokenizer)


def not_the_base(model):
    """name -> dtype of the buffers and LoRA weights: what a rollout copy leaves as it is."""
    return {n: b.dtype for n, b in model.named_buffers()} | {
        n: p.dtype for n, p in model.named_parameters() if ".lora_" in n
    }


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_a_bf16_rollout_copy_is_the_model_loaded_in_bf16(adapted, micro_model, saved_adapter):
    """The bfloat16 copy of a float32 model samples exactly (tokens and log-probs) as the same files
    loaded in bfloat16 by from_pretrained (and peft): the base's weights rounded, while the rotary
    inv_freq buffers and a LoRA adapter stay float32, as such a load keeps them. Casting the whole
    copy rounded them too, a difference that is not the base's rounding."""
    path = saved_adapter if adapted else micro_model
    model, tokenizer = load_model_and_tokenizer(path, torch.float32, trainable_adapter=True)
    copy = RolloutPolicy(model, torch.bfloat16).model
    loaded, _ = load_model_and_tokenizer(path, torch.bfloat16)
    kept = not_the_base(loaded)
    assert any(n.endswith("inv_freq") for n in kept) and set(kept.values()) == {torch.float32}
    assert not_the_base(copy) == kept
    assert samples(copy, tokenizer) == samples(loaded, tokenizer)
    assert samples(copy, tokenizer) != samples(model, tokenizer)  # the base's rounding is there


# ------------------------------------------------------------------------------ KL reference of a given adapter
KL = dict(use_peft=True, kl_coef=0.1, reward_funcs=["tests.reward_fns:length_bonus"])


def adapter_weights(model, name):
    """The LoRA weights of adapter `name`, under names without it."""
    return {
        n.replace(f".{name}.", "."): p
        for n, p in model.named_parameters()
        if f".lora_A.{name}." in n or f".lora_B.{name}." in n
    }


def test_an_adapter_given_as_model_is_its_own_kl_reference(saved_adapter, micro_model, tmp_path):
    """--model ADAPTER --use_peft: as full fine-tuning's reference is --model, the reference is the
    given adapter, frozen: at step 0 its log-probs are the policy's exactly (pi_old, and the update's
    own: loss/kl_ref is 0) and the adapter's loaded on its own; the base is far from them. Training
    moves the trained adapter and never the reference, which no optimizer state covers."""
    config = micro_config(saved_adapter, tmp_path / "run", anchor="old", mini_batch_size=16, epochs=1, steps=2, **KL)
    trainer = Trainer(config)
    assert trainer.lora_reference == "adapter" and trainer.ref_model is None
    rollout, _ = trainer.rollout(0)
    prepared = trainer.prepare(rollout)
    valid = prepared.response_mask.bool()
    assert torch.equal(prepared.logp_ref[valid], prepared.logp_old[valid])
    given, _ = load_model_and_tokenizer(saved_adapter)
    base, _ = load_model_and_tokenizer(micro_model)
    with torch.no_grad():
        alone = policy_outputs(given, rollout, 1.0).logp[valid]
        bare = policy_outputs(base, rollout, 1.0).logp[valid]
    torch.testing.assert_close(prepared.logp_ref[valid], alone, rtol=0, atol=1e-6)
    assert (prepared.logp_ref[valid] - bare).abs().max() > 0.05

    frozen = {n: p.clone() for n, p in adapter_weights(trainer.model, REFERENCE).items()}
    assert frozen.keys() == adapter_weights(given, "default").keys()
    assert all(
        torch.equal(p, given_p) for p, given_p in zip(frozen.values(), adapter_weights(given, "default").values())
    )
    assert not any(p.requires_grad for p in adapter_weights(trainer.model, REFERENCE).values())
    trainable = {id(p) for p in trainer.trainable}
    assert trainable == {id(p) for p in adapter_weights(trainer.model, "default").values()}
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["loss/kl_ref"] == 0 and records[2]["loss/kl_ref"] > 0  # one update per step
    for name, p in adapter_weights(trainer.model, REFERENCE).items():
        assert torch.equal(p, frozen[name]) and not p.requires_grad, name
    assert any(not torch.equal(p, frozen[n]) for n, p in adapter_weights(trainer.model, "default").items())
    assert all(p.requires_grad for p in adapter_weights(trainer.model, "default").values())
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == trainable


def test_lora_reference_base_keeps_the_base_as_reference(saved_adapter, micro_model, tmp_path):
    trainer = Trainer(micro_config(saved_adapter, tmp_path / "run", lora_reference="base", **KL))
    assert REFERENCE not in trainer.model.peft_config
    rollout, _ = trainer.rollout(0)
    prepared = trainer.prepare(rollout)
    base, _ = load_model_and_tokenizer(micro_model)
    valid = prepared.response_mask.bool()
    with torch.no_grad():
        bare = policy_outputs(base, rollout, 1.0).logp[valid]
    torch.testing.assert_close(prepared.logp_ref[valid], bare, rtol=0, atol=1e-6)
    trainer.close()


def test_training_on_against_the_given_adapter_resumes_bit_identically(saved_adapter, tmp_path):
    """Checkpoints and final/ hold the trained adapter alone (not the frozen reference); a resumed
    run reloads the reference from --model and reaches the uninterrupted run's weights bit for bit."""
    full = Trainer(micro_config(saved_adapter, tmp_path / "full", **KL))
    full.train()
    interrupted = Trainer(micro_config(saved_adapter, tmp_path / "resumed", **KL))
    assert interrupted.train(stop_after=1) is None
    for saved in (tmp_path / "resumed" / "checkpoints" / "step_000001", tmp_path / "full" / "final"):
        assert not (saved / REFERENCE).exists() and (saved / "adapter_model.safetensors").is_file()
    resumed = Trainer.resume(tmp_path / "resumed", {"progress": False})
    resumed.train()
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), full.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    given, reference = load_model_and_tokenizer(saved_adapter)[0], adapter_weights(resumed.model, REFERENCE)
    assert reference.keys() == adapter_weights(given, "default").keys()
    for p, q in zip(reference.values(), adapter_weights(given, "default").values()):
        assert torch.equal(p, q)


def test_lora_reference_is_refused_where_it_means_nothing(micro_model, saved_adapter, tmp_path):
    with pytest.raises(ConfigError, match="--lora_reference base would be ignored: it applies with --use_peft"):
        micro_config(saved_adapter, tmp_path / "a", kl_coef=0.1, lora_reference="base")
    with pytest.raises(ConfigError, match=r"--lora_reference adapter would be ignored: it applies with a KL term"):
        micro_config(saved_adapter, tmp_path / "b", use_peft=True, lora_reference="adapter")
    with pytest.raises(ConfigError, match="--lora_reference base would be ignored: it applies when --model is a LoRA"):
        Trainer(micro_config(micro_model, tmp_path / "c", lora_reference="base", **KL))


def _randomize_lora_b(model, seed: int) -> None:
    """B drawn at 0.3 x N(0, 1) (peft starts it at 0): the adapted policy is not the base's."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
