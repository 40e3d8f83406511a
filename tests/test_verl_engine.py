"""The gppo loss inside verl 0.9.1's own actor training step, on CPU.

verl's path, run unchanged: TrainingWorker.train_mini_batch -> FSDPEngineWithLMHead (FSDP2, gloo)
-> forward_step / prepare_model_outputs -> verl.workers.utils.losses.ppo_loss -> the policy-loss
function registered for actor.policy_loss.loss_mode. The actor config is composed from
examples/verl/config/gppo_trainer.yaml and instantiated as verl's trainer does; the batch goes
through verl's left_right_2_no_padding and the non-tensor fields RayPPOTrainer._update_actor sets.
tests/verl_cpu_shim.py holds what CPU needs (device platform, engine lookup, process group).

The optimiser is SGD with lr 1 and no clipping, so that the weight change of one step is minus the
gradient (Adam's first step is lr * sign(g): it would hide gradient differences). Each world size
runs in fresh processes (1 process, then 2 ranks splitting the batch as verl's dispatch does), every
loss mode in turn from the same initial weights. Checked:
- gppo_ppo (dual_clip=3) updates the weights exactly as verl's vanilla (clip_ratio 0.2, c = 3);
- gppo_ppo and gppo_dppo_binary_kl update them by -lr * grad of gppo.policy_loss written on the
  plain Hugging Face model (independent of verl: padded batch, the preset, token-mean);
- 2 ranks (verl's global token count and FSDP's gradient average) give the 1-process update;
- gppo_dppo_binary_kl's update differs from vanilla's (the comparison can fail);
- with verl's LoRA settings (actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, and
  lora_adapter_path for an adapter saved before), only the adapter's weights move, and by -lr *
  grad of gppo.policy_loss with respect to them, written on a peft-wrapped Hugging Face model that
  starts from the engine's own initial adapter; with the top-K estimator too (topk_ppo_loss on the
  logits of verl's peft-wrapped actor).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

for _module in ("verl", "hydra", "peft", "uvicorn", "fastapi"):  # engine_workers imports the last three
    pytest.importorskip(_module)

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "examples" / "verl" / "config"
# loss_mode -> policy_loss fields (vanilla's settings are verl's defaults: clip_ratio 0.2, clip_ratio_c 3)
# The embedded model's probabilities are near 1/55, so a ratio of e^(+-0.5) moves the binary KL by
# ~0.004: delta 0.002 instead of 0.05 makes the DPPO mask keep some tokens and drop others.
DPPO_FIELDS = {"delta_low": 0.002, "delta_high": 0.002}
TOPK_FIELDS = {"delta_low": 0.002, "delta_high": 0.002}
MODES = {
    "vanilla": {},
    "gppo_ppo": {"dual_clip": 3.0},
    "gppo_dppo_binary_kl": DPPO_FIELDS,
    "gppo_dppo_topk_kl": {"topk_source": "batch", **TOPK_FIELDS},
}
PRESETS = {
    "gppo_ppo": ("ppo", {"dual_clip": 3.0}),
    "gppo_dppo_binary_kl": ("dppo-binary-kl", DPPO_FIELDS),
    "gppo_dppo_topk_kl": ("dppo-topk-kl", TOPK_FIELDS),
}
BATCH, PROMPT_LEN, RESPONSE_LEN, MICRO_BATCH, TOP_K = 8, 6, 10, 2, 20
# verl's FSDP LoRA settings (actor_rollout_ref.model.*; verl's FSDPEngine._build_lora_module passes
# them to peft's LoraConfig). lora_alpha is not verl's default 16, so that a dropped alpha (the
# adapter's scale alpha / r) changes the update.
LORA = {"lora_rank": 8, "lora_alpha": 32, "target_modules": "all-linear"}
ADAPTER_DIR = "adapter"  # in the work folder: an adapter with lora_B != 0, for lora_adapter_path
# run name -> (loss_mode, policy_loss fields, actor_rollout_ref.model fields). "lora" starts from
# verl's fresh adapter (lora_B = 0: at the first step only lora_B has a gradient); "lora_loaded"
# from ADAPTER_DIR, where lora_A has one too.
LORA_RUNS = {
    "lora/gppo_dppo_binary_kl": ("gppo_dppo_binary_kl", DPPO_FIELDS, LORA),
    "lora/gppo_dppo_topk_kl": ("gppo_dppo_topk_kl", MODES["gppo_dppo_topk_kl"], LORA),
    "lora_loaded/gppo_dppo_topk_kl": (
        "gppo_dppo_topk_kl",
        MODES["gppo_dppo_topk_kl"],
        {**LORA, "lora_adapter_path": ADAPTER_DIR},
    ),
}


def make_batch(model_dir) -> dict[str, torch.Tensor]:
    """verl's padded rollout batch: left-padded prompts, right-padded responses of ragged lengths,
    one advantage of either sign per sequence. mu = softmax(the model's logits + N(0, 0.5^2) per
    entry) (ratios on both sides of the clip range): old_log_probs = log mu of the sampled tokens;
    mu's top-K ids and log-probs in teacher_ids / teacher_logprobs [B, S, K], entry p for the token
    at p + 1 (the plugin's carriage, gppo.integrations.verl.TOPK_IDS_KEY). The response tokens are
    drawn uniformly, not from mu: the losses and their references take them as given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt_mask = torch.arange(PROMPT_LEN) >= PROMPT_LEN - torch.randint(2, PROMPT_LEN + 1, (BATCH, 1), generator=gen)
    response_mask = torch.arange(RESPONSE_LEN) < torch.randint(3, RESPONSE_LEN + 1, (BATCH, 1), generator=gen)
    prompts = torch.randint(3, vocab, (BATCH, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(3, vocab, (BATCH, RESPONSE_LEN), generator=gen) * response_mask
    input_ids = torch.cat([prompts, responses], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = response_logits(model, input_ids, attention_mask, position_ids)
    log_mu = torch.log_softmax(logits + 0.5 * torch.randn(logits.shape, generator=gen), -1)
    old = log_mu.gather(-1, responses[..., None])[..., 0] * response_mask
    top_logp, top_ids = log_mu.topk(TOP_K, dim=-1)
    sequence_ids = torch.zeros(BATCH, PROMPT_LEN + RESPONSE_LEN, TOP_K, dtype=torch.long)
    sequence_logp = torch.zeros(BATCH, PROMPT_LEN + RESPONSE_LEN, TOP_K)
    sequence_ids[:, PROMPT_LEN - 1 : -1] = top_ids * response_mask[..., None]
    sequence_logp[:, PROMPT_LEN - 1 : -1] = top_logp * response_mask[..., None]
    adv = torch.randn(BATCH, 1, generator=gen).expand(BATCH, RESPONSE_LEN) * response_mask
    return dict(
        prompts=prompts,
        responses=responses,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask.float(),
        old_log_probs=old,
        advantages=adv.contiguous(),
        teacher_ids=sequence_ids,
        teacher_logprobs=sequence_logp,
        mu_topk_ids=top_ids,
        mu_topk_logp=top_logp,
    )


def response_logits(model, input_ids, attention_mask, position_ids):
    """[B, R, V] float32 logits of the distributions that predict the response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, PROMPT_LEN - 1 : -1].float()


def lora_model(model_dir, adapter=None):
    """The Hugging Face model wrapped by peft with LORA (peft's own names for verl's settings);
    `adapter`: the adapter weights to start from, by peft's state-dict names."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"], target_modules=LORA["target_modules"])
    model = get_peft_model(model, config)
    if adapter is not None:
        missing, unexpected = model.load_state_dict(adapter, strict=False)
        assert not unexpected and not [k for k in missing if "lora_" in k], (missing, unexpected)
    return model


def save_adapter(model_dir, path):
    """Save a LORA adapter as peft saves one, with lora_B ~ N(0, 0.02^2) (peft starts it at 0): both
    lora_A and lora_B then have a gradient at the first step, and the policy moves little. Returns
    its weights by peft's state-dict names."""
    model = lora_model(model_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return adapter_weights(model.state_dict())


def adapter_weights(weights):
    return {k: v.detach().clone() for k, v in weights.items() if ".lora_" in k}


def reference_update(model_dir, batch, mode, adapter=None):
    """-grad of gppo.policy_loss (token-mean over the whole batch) on the Hugging Face model; with
    `adapter` (the initial LoRA weights), on the peft-wrapped model, w.r.t. the adapter's weights."""
    from transformers import AutoModelForCausalLM

    import gppo

    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = lora_model(model_dir, adapter)
    preset, fields = PRESETS[mode]
    log_pi = torch.log_softmax(
        response_logits(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"]), -1
    )
    tokens = gppo.TokenBatch(
        logp=log_pi.gather(-1, batch["responses"][..., None])[..., 0],
        logp_behavior=batch["old_log_probs"],
        advantages=batch["advantages"],
        mask=batch["response_mask"].bool(),
        token_ids=batch["responses"],
        topk_ids=batch["mu_topk_ids"],
        topk_logp=log_pi.gather(-1, batch["mu_topk_ids"]),
        topk_logp_behavior=batch["mu_topk_logp"],
    )
    loss, _ = gppo.policy_loss(tokens, gppo.preset(preset, loss_agg_mode="token-mean", **fields))
    loss.backward()
    return {name: -p.grad for name, p in model.named_parameters() if p.requires_grad}


# ---- the engine side, run in fresh processes: python -m tests.test_verl_engine DIR RANK WORLD PORT ----


def actor_config(model_dir, mode, fields, model_fields=None):
    """ActorConfig as ActorRolloutRefWorker.init_model builds it, from the shipped gppo_trainer config
    (`model_fields`: overrides of actor_rollout_ref.model, e.g. verl's LoRA settings)."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    actor = "actor_rollout_ref.actor"
    overrides = [
        "hydra.searchpath=[pkg://verl.trainer.config]",
        f"actor_rollout_ref.model.path={model_dir}",
        # CPU: sdpa instead of flash-attn; padded batches (packed ones need flash-attn's varlen kernel)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        f"{actor}.strategy=fsdp2",
        f"{actor}.fsdp_config.model_dtype=fp32",
        *(f"+{actor}.fsdp_config.mixed_precision.{k}=fp32" for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
        f"{actor}.use_torch_compile=false",
        f"{actor}.entropy_coeff=0",
        f"{actor}.use_kl_loss=false",
        f"{actor}.ppo_mini_batch_size={BATCH}",
        f"{actor}.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"{actor}.optim.optimizer=SGD",
        f"{actor}.optim.lr=1.0",
        f"{actor}.optim.weight_decay=0",
        f"{actor}.optim.clip_grad=1e9",
        f"{actor}.policy_loss.loss_mode={mode}",
        # ++: topk_source is not among the fields examples/verl/config/gppo_trainer.yaml declares
        *(f"++{actor}.policy_loss.{k}={v}" for k, v in fields.items()),
        *(f"actor_rollout_ref.model.{k}={v}" for k, v in (model_fields or {}).items()),
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="gppo_trainer", overrides=overrides)
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    config.model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    return config


def full_weights(module):
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.state_dict().items()
    }


def train_one_step(model_dir, batch, mode, fields, rank, world, model_fields=None):
    """One train_mini_batch of TrainingWorker; for the top-K mode the worker's loss function is the
    plugin's topk_ppo_loss and the batch asks verl's engine for its logits processor."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from gppo.integrations.verl import topk_ppo_loss

    config = actor_config(model_dir, mode, fields, model_fields)
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
    assert worker.engine.get_data_parallel_size() == world
    topk = "topk_source" in fields
    worker.set_loss_fn(partial(topk_ppo_loss if topk else ppo_loss, config=config))
    before = full_weights(worker.engine.module)

    per_rank = BATCH // world  # verl's dispatch hands each data-parallel rank a contiguous chunk
    chunk = {
        k: v[rank * per_rank : (rank + 1) * per_rank]
        for k, v in batch.items()
        if not k.startswith("mu_") and (topk or not k.startswith("teacher_"))
    }
    data = left_right_2_no_padding(tu.get_tensordict(chunk, {"temperature": 1.0}))
    tu.assign_non_tensor(
        data,
        calculate_entropy=False,
        distillation_use_topk=topk,
        distillation_only=False,
        global_batch_size=BATCH,
        mini_batch_size=BATCH,
        epochs=1,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    metrics = tu.get(worker.train_mini_batch(data), "metrics")
    metrics = {
        k: [float(x) for x in v] if isinstance(v, list) else float(v)
        for k, v in metrics.items()
        if not k.startswith("perf")
    }
    return before, full_weights(worker.engine.module), metrics


def engine_main(workdir, rank, world, port):
    from tests import verl_cpu_shim

    verl_cpu_shim.install(rank=rank, world_size=world, port=port)
    torch.set_num_threads(1)
    batch = torch.load(Path(workdir) / "batch.pt")
    results = {}
    for mode, fields in MODES.items():
        before, after, metrics = train_one_step(Path(workdir) / "model", batch, mode, fields, rank, world)
        results[mode] = {"before": before, "after": after, "metrics": metrics}
    for name, (mode, fields, model_fields) in LORA_RUNS.items():
        model_fields = {**model_fields}
        if "lora_adapter_path" in model_fields:
            model_fields["lora_adapter_path"] = Path(workdir) / model_fields["lora_adapter_path"]
        before, after, metrics = train_one_step(Path(workdir) / "model", batch, mode, fields, rank, world, model_fields)
        results[name] = {"before": before, "after": after, "metrics": metrics}
    if rank == 0:
        torch.save(results, Path(workdir) / f"world{world}.pt")
    torch.distributed.destroy_process_group()


# ---- the tests ----


def run_engine(workdir, world, limit_s=600):
    """The ranks in subprocesses (logs in workdir); a rank that fails ends the others, whose
    collectives would otherwise wait for it."""
    import time

    from tests.verl_cpu_shim import free_port

    port = str(free_port())
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    logs = [Path(workdir) / f"world{world}-rank{rank}.log" for rank in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.test_verl_engine", str(workdir), str(rank), str(world), port],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + limit_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log.read_text()[-6000:]
    return torch.load(Path(workdir) / f"world{world}.pt")


@pytest.fixture(scope="module")
def engine(micro_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("verl_engine")
    os.symlink(micro_model, workdir / "model")
    batch = make_batch(micro_model)
    torch.save(batch, workdir / "batch.pt")
    adapter = save_adapter(micro_model, workdir / ADAPTER_DIR)
    return {
        "batch": batch,
        "model": micro_model,
        "adapter": adapter,
        1: run_engine(workdir, 1),
        2: run_engine(workdir, 2),
    }


def update(run, mode):
    return {k: run[mode]["after"][k] - run[mode]["before"][k] for k in run[mode]["before"]}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def scale(u):
    return max(v.abs().max().item() for v in u.values())


@pytest.mark.parametrize("world", [1, 2])
def test_gppo_ppo_step_equals_verl_vanilla(engine, world):
    run = engine[world]
    assert max_diff(run["gppo_ppo"]["before"], run["vanilla"]["before"]) == 0
    clipped = run["vanilla"]["metrics"]["actor/pg_clipfrac"]
    assert all(0 < c < 1 for c in clipped), clipped  # both branches of the clip occur
    ours, verl = update(run, "gppo_ppo"), update(run, "vanilla")
    assert scale(verl) > 1e-3
    assert max_diff(ours, verl) <= 1e-6 * scale(verl), max_diff(ours, verl)
    assert run["gppo_ppo"]["metrics"]["loss"] == pytest.approx(run["vanilla"]["metrics"]["loss"], rel=1e-5)


@pytest.mark.parametrize("mode", list(PRESETS))
@pytest.mark.parametrize("world", [1, 2])
def test_engine_step_is_minus_the_gppo_gradient(engine, mode, world):
    reference = reference_update(engine["model"], engine["batch"], mode)
    got = update(engine[world], mode)
    shared = [k for k in reference if k in got]
    assert len(shared) == len(reference)
    got, reference = {k: got[k] for k in shared}, {k: reference[k] for k in shared}
    assert max_diff(got, reference) <= 1e-5 * scale(reference), (max_diff(got, reference), scale(reference))


def test_second_preset_trains_and_differs_from_vanilla(engine):
    run = engine[1]
    metrics = run["gppo_dppo_binary_kl"]["metrics"]
    loss = metrics["loss"]
    assert all(torch.isfinite(torch.tensor(v)) for v in loss), loss
    assert all(0 < m < 1 for m in metrics["gppo/masked_frac"]), metrics["gppo/masked_frac"]
    ours, verl = update(run, "gppo_dppo_binary_kl"), update(run, "vanilla")
    assert scale(ours) > 1e-3
    assert max_diff(ours, verl) > 1e-2 * scale(verl)


@pytest.mark.parametrize("world", [1, 2])
def test_topk_estimator_trains_through_the_engine_logits_processor(engine, world):
    """gppo_dppo_topk_kl with mu's top-K in the batch: the mask keeps some tokens and drops others,
    and the update differs from the binary estimator's (the top-K estimate is another number)."""
    run = engine[world]
    metrics = run["gppo_dppo_topk_kl"]["metrics"]
    assert all(0 < m < 1 for m in metrics["gppo/masked_frac"]), metrics["gppo/masked_frac"]
    ours, binary = update(run, "gppo_dppo_topk_kl"), update(run, "gppo_dppo_binary_kl")
    assert scale(ours) > 1e-3
    assert max_diff(ours, binary) > 1e-2 * scale(binary)


@pytest.mark.parametrize("name", list(LORA_RUNS))
@pytest.mark.parametrize("world", [1, 2])
def test_lora_step_moves_the_adapter_by_minus_the_gppo_gradient(engine, name, world):
    """verl's LoRA settings: rank 8 on every linear layer but the output head (peft's all-linear),
    the base model frozen, the adapter's update -lr * grad of gppo.policy_loss w.r.t. the adapter
    (lr 1), the gradient taken on a peft-wrapped model with lora_alpha 32 from the engine's initial adapter."""
    from transformers import AutoModelForCausalLM

    run, mode = engine[world][name], LORA_RUNS[name][0]
    start = adapter_weights(run["before"])
    base = AutoModelForCausalLM.from_pretrained(engine["model"])
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert {k.removeprefix("base_model.model.").split(".lora_")[0] for k in start} == linear
    assert {v.shape[0] for k, v in start.items() if ".lora_A." in k} == {LORA["lora_rank"]}

    got = update(engine[world], name)
    frozen = [k for k in got if k not in start]
    assert len(frozen) == len(base.state_dict())
    assert all(got[k].abs().max() == 0 for k in frozen)
    reference = reference_update(engine["model"], engine["batch"], mode, start)
    assert set(reference) == set(start)
    got = {k: got[k] for k in reference}
    assert scale(reference) > 1e-3
    assert max_diff(got, reference) <= 1e-5 * scale(reference), (max_diff(got, reference), scale(reference))
    masked = run["metrics"]["gppo/masked_frac"]
    assert all(0 < m < 1 for m in masked), masked


def test_lora_adapter_starts_where_verl_settings_say(engine):
    """A fresh adapter has lora_B = 0, so only lora_B moves at the first step; lora_adapter_path
    loads the saved adapter, and then lora_A moves too: each lora_A by its own SGD step, -lr * grad
    of gppo.policy_loss at the loaded adapter (lr 1), computed here. The smallest step depends on
    peft's random lora_A init (the global RNG's state when the adapter is saved: 9.0e-5 to 2.1e-4
    over four states), so each update is compared with its own step, within 1 % (the engine's are
    within 1e-4 of it), and no step is 0 (lora_B != 0 gives every lora_A a gradient)."""
    run = engine[1]
    fresh = adapter_weights(run["lora/gppo_dppo_topk_kl"]["before"])
    assert all(v.abs().max() == 0 for k, v in fresh.items() if ".lora_B." in k)
    moved = update(run, "lora/gppo_dppo_topk_kl")
    assert all(moved[k].abs().max() == 0 for k in fresh if ".lora_A." in k)
    name = "lora_loaded/gppo_dppo_topk_kl"
    loaded = adapter_weights(run[name]["before"])
    assert max_diff(loaded, engine["adapter"]) == 0
    moved = update(run, name)
    step = reference_update(engine["model"], engine["batch"], LORA_RUNS[name][0], loaded)
    for key in (k for k in loaded if ".lora_A." in k):
        size = step[key].abs().max().item()
        error = (moved[key] - step[key]).abs().max().item()
        assert size > 0 and error <= 1e-2 * size, (key, size, error)


if __name__ == "__main__":
    engine_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
