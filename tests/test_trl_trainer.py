"""GPPOTrainer against TRL's own GRPOTrainer, on CPU with a tiny local Qwen2 model.

TRL loss type -> equivalent GPPOTrainerConfig (also in docs/trl.md):

| GRPOConfig                                              | GPPOTrainerConfig                                   |
|---------------------------------------------------------|-----------------------------------------------------|
| loss_type="dapo" (default), epsilon=0.2                 | gppo_preset="ppo"                                   |
| loss_type="dapo", epsilon_high=0.28                     | gppo_preset="dapo"                                  |
| loss_type="grpo"                                        | gppo_preset="grpo"                                  |
| loss_type="dr_grpo"                                     | gppo_preset="dr-grpo"                               |
| loss_type="bnpo" (one micro-batch per step)             | gppo_preset="ppo"                                   |
| loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4 | gppo_preset="luspo" |
| loss_type="vespo"                                       | gppo_preset="vespo"                                 |
| loss_type="grpo", off_policy_mask_threshold=0.05        | gppo_preset="grpo", off_policy_threshold 0.05       |
| loss_type="cispo", epsilon_high=5.0                     | gppo_preset="cispo"                                 |
| loss_type="sapo"                                        | gppo_preset="sapo", loss_agg_mode seq-mean-token-mean |
| loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4 | gppo_preset="gspo" |
| beta=0.04, use_bias_correction_kl=False (k3 KL)         | beta=0.04, use_bias_correction_kl=False             |
"""

import re
import sys

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import gppo  # noqa: E402
from gppo.integrations.trl import GPPOTrainer, GPPOTrainerConfig  # noqa: E402
from gppo.models.embedded import build_model, build_tokenizer  # noqa: E402
from tests import trl_tools  # noqa: E402

PROMPTS = ["12+3=", "4*5=", "7-2=", "9+9=", "1+1=", "30/3=", "8-8=", "2*7="]

# name: (GRPOConfig fields, GPPOTrainerConfig fields, noise on log pi_old, metric that must lie
# strictly inside (0, 1) so that both branches of the rule are exercised)
EQUIVALENTS = {
    "ppo": ({}, dict(gppo_preset="ppo"), 0.5, "gppo/masked_frac"),
    "dapo": (dict(epsilon_high=0.28), dict(gppo_preset="dapo"), 0.5, "gppo/masked_frac"),
    "grpo": (dict(loss_type="grpo"), dict(gppo_preset="grpo"), 0.5, "gppo/masked_frac"),
    "dr_grpo": (dict(loss_type="dr_grpo"), dict(gppo_preset="dr-grpo"), 0.5, "gppo/masked_frac"),
    # bnpo divides by the micro-batch's tokens, ppo (TRL's dapo) by the accumulation window's:
    # the same with one micro-batch per optimizer step, as here
    "bnpo": (dict(loss_type="bnpo"), dict(gppo_preset="ppo"), 0.5, "gppo/masked_frac"),
    "luspo": (
        dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        dict(gppo_preset="luspo"),
        1e-3,
        "gppo/masked_frac",
    ),
    "vespo": (dict(loss_type="vespo"), dict(gppo_preset="vespo"), 0.5, None),
    "grpo+opsm": (
        dict(loss_type="grpo", off_policy_mask_threshold=0.05),
        dict(gppo_preset="grpo", gppo_overrides={"off_policy_threshold": 0.05}),
        0.5,
        "gppo/masked_frac",
    ),
    "cispo": (dict(loss_type="cispo", epsilon_high=5.0), dict(gppo_preset="cispo"), 2.5, "gppo/truncated_frac"),
    "sapo": (
        dict(loss_type="sapo"),
        dict(gppo_preset="sapo", gppo_overrides={"loss_agg_mode": "seq-mean-token-mean"}),
        0.5,
        None,
    ),
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        dict(gppo_preset="gspo"),
        1e-3,
        "gppo/masked_frac",
    ),
    "ppo+kl": (
        dict(beta=0.04, use_bias_correction_kl=False),
        dict(gppo_preset="ppo", beta=0.04, use_bias_correction_kl=False),
        0.5,
        "gppo/masked_frac",
    ),
}


def reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved 1-layer Qwen2 with gppo's character tokenizer (passed as an object: TRL would load
    the folder with AutoTokenizer, which returns the wrong class for it)."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).save_pretrained(path / "model")
    return str(path / "model"), tokenizer, path


# One generation batch of 4 completions of one prompt per optimizer step; with num_iterations=2 the
# second step reuses it, so that its ratios are not 1.
SETTINGS = dict(
    use_cpu=True,
    report_to="none",
    seed=0,
    per_device_train_batch_size=4,
    num_generations=4,
    max_steps=2,
    logging_steps=1,
    learning_rate=5e-2,
    save_strategy="no",
    num_iterations=2,
)


def make_trainer(tiny, trainer_cls, config_cls, peft_config=None, **fields):
    model, tokenizer, path = tiny
    settings = dict(output_dir=str(path / "out"), max_completion_length=8, **SETTINGS)
    args = config_cls(**{**settings, **fields})
    return trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config,
    )


def handcrafted_inputs(trainer, tokenizer, noise, beta):
    """One micro-batch as TRL's generation step leaves it, with pi_old (and the reference)
    perturbed away from pi so that ratios reach the clip / truncation bounds."""
    gen = torch.Generator().manual_seed(0)
    prompts = tokenizer(PROMPTS[:4], return_tensors="pt", padding=True)
    completion_ids = torch.randint(3, len(tokenizer), (4, 6), generator=gen)
    completion_mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 5, 1])[:, None]).long()
    inputs = dict(
        prompt_ids=prompts.input_ids,
        prompt_mask=prompts.attention_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.0, -0.5, 0.8, -1.2]),
        num_items_in_batch=completion_mask.sum(),
    )
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1),
            6,
        )
    inputs["old_per_token_logps"] = logp + noise * torch.randn(logp.shape, generator=gen)
    if beta:
        inputs["ref_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop during training
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("name", list(EQUIVALENTS))
def test_gppo_loss_equals_trl_loss_and_gradient(tiny, name):
    trl_fields, gppo_fields, noise, branch_metric = EQUIVALENTS[name]
    trl = make_trainer(tiny, GRPOTrainer, GRPOConfig, **trl_fields)
    ours = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, **gppo_fields)
    inputs = handcrafted_inputs(trl, tiny[1], noise, trl_fields.get("beta", 0.0))
    trl_loss, trl_grads = loss_and_grads(trl, inputs)
    loss, grads = loss_and_grads(ours, inputs)
    if branch_metric is not None:
        assert 0 < ours._metrics["train"][branch_metric][-1] < 1
    assert max(g.abs().max() for g in trl_grads) > 0
    assert torch.allclose(loss, trl_loss, rtol=0, atol=1e-6), (loss, trl_loss)
    for g, trl_g in zip(grads, trl_grads, strict=True):
        assert torch.allclose(g, trl_g, rtol=0, atol=1e-6), (g - trl_g).abs().max()


def final_parameters(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_two_step_run_matches_grpo_trainer(tiny):
    """Same seed, same generations: GPPOTrainer(ppo) logs TRL's losses and ends at TRL's weights.
    With num_iterations=2 the second step reuses the batch, so its ratios are not 1."""
    trl = make_trainer(tiny, GRPOTrainer, GRPOConfig)
    trl.train()
    ours = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, gppo_preset="ppo")
    ours.train()
    trl_losses = [h["loss"] for h in trl.state.log_history if "loss" in h]
    losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[1] != 0
    assert losses == pytest.approx(trl_losses, abs=1e-7)
    assert ours.state.log_history[1]["gppo/ratio/max"] > 1
    for p, trl_p in zip(final_parameters(ours), final_parameters(trl), strict=True):
        assert torch.allclose(p, trl_p, rtol=0, atol=1e-6)


def test_lora_adapter_run_matches_grpo_trainer_and_topk_trains(tiny):
    """With a LoRA adapter (TRL's peft_config, all linear layers of the decoder): GPPOTrainer(ppo)
    ends at GRPOTrainer(loss_type="dapo")'s adapter weights, and dppo-topk-kl, whose top-K passes
    run the peft-wrapped model's forward with gppo.token_stats as its output layer, moves the
    adapter and leaves the base weights as they were."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")

    def adapter(trainer):
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}

    trl = make_trainer(tiny, GRPOTrainer, GRPOConfig, peft_config=lora())
    trl.train()
    ours = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, peft_config=lora(), gppo_preset="ppo")
    ours.train()
    theirs, mine = adapter(trl), adapter(ours)
    assert mine and mine.keys() == theirs.keys()
    assert any(p.abs().max() > 0 for n, p in mine.items() if "lora_B" in n)  # B starts at 0: it moved
    for name, p in mine.items():
        assert torch.allclose(p, theirs[name], rtol=0, atol=1e-6), name

    topk = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, peft_config=lora(), gppo_preset="dppo-topk-kl")
    base = {n: p.detach().clone() for n, p in topk.model.named_parameters() if "lora_" not in n}
    before = adapter(topk)
    topk.train()
    logs = [h for h in topk.state.log_history if "loss" in h]
    assert len(logs) == 2 and "gppo/masked_frac" in logs[1] and logs[1]["gppo/ratio/max"] > 1
    assert any(not torch.equal(p, before[n]) for n, p in adapter(topk).items())
    for n, p in topk.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n


@pytest.mark.parametrize("preset", ["dppo-binary-tv", "dppo-topk-tv", "cispo", "gppo", "icepop", "cppo", "drpo"])
def test_two_step_run_per_preset(tiny, preset):
    trainer = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, gppo_preset=preset)
    before = final_parameters(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert logs[1]["gppo/ratio/max"] > 1
    # icepop reports both fractions; drpo's penalty blocks no token
    metric = {"cispo": "gppo/truncated_frac", "drpo": "gppo/ratio/mean"}.get(preset, "gppo/masked_frac")
    assert metric in logs[1] and "entropy" in logs[1]
    assert any(not torch.equal(a, b) for a, b in zip(before, final_parameters(trainer)))


@pytest.mark.parametrize("preset", list(gppo.PRESETS))
def test_every_preset_is_accepted(tiny, preset):
    """GPPOTrainerConfig builds every preset (rollout top-K comes from its own old-policy pass)."""
    cfg = GPPOTrainerConfig(
        output_dir=str(tiny[2] / "cfg"), use_cpu=True, gppo_preset=preset, max_completion_length=8
    ).gppo_config()
    assert cfg.rule == gppo.PRESETS[preset].fields["rule"] and cfg.norm_length == 8


def test_topk_pass_records_the_sampling_policy(tiny):
    """The extra pass for top-K estimators scores the sampled tokens as TRL's own old-policy pass
    does (the generating weights, i.e. mu under transformers' generate), and keeps that
    distribution's top-K in descending order."""
    trainer = make_trainer(
        tiny, GPPOTrainer, GPPOTrainerConfig, gppo_preset="dppo-topk-tv", gppo_overrides={"top_k": 5}, max_steps=1
    )
    trainer.train()
    batch = trainer._buffered_inputs[0]
    mask = batch["completion_mask"].bool()
    assert torch.allclose(batch["gppo_logp_old"][mask], batch["old_per_token_logps"][mask], atol=1e-5)
    topk = batch["gppo_topk_logp_old"]
    assert topk.shape == (*mask.shape, 5) and batch["gppo_topk_ids"].shape == (*mask.shape, 5)
    assert (topk[..., :-1] >= topk[..., 1:]).all()
    assert (batch["gppo_logp_old"][mask] <= topk[..., 0][mask] + 1e-6).all()


def test_config_refuses_what_it_would_ignore(tiny):
    path = str(tiny[2] / "cfg")

    def config(**fields):
        return GPPOTrainerConfig(output_dir=path, use_cpu=True, **fields)

    with pytest.raises(gppo.GPPOConfigError, match=r"\['loss_type', 'epsilon'\] would be ignored"):
        config(loss_type="grpo", epsilon=0.1)
    with pytest.raises(gppo.GPPOConfigError, match="top_entropy_quantile"):
        config(top_entropy_quantile=0.2)
    with pytest.raises(gppo.GPPOConfigError, match="beta"):
        config(gppo_overrides={"kl_coef": 0.1})
    with pytest.raises(gppo.GPPOConfigError, match="use_bias_correction_kl=False"):
        config(beta=0.04)
    with pytest.raises(gppo.GPPOConfigError, match="estimator='full'"):
        config(gppo_overrides={"estimator": "full"})
    with pytest.raises(gppo.GPPOConfigError, match="unknown preset"):
        config(gppo_preset="dppo")
    cfg = config(
        gppo_preset="dppo-binary-kl",
        beta=0.01,
        use_bias_correction_kl=False,
        gppo_overrides='{"divergence": "hellinger", "delta_high": 0.2}',
    )
    point = cfg.gppo_config()
    assert (point.divergence, point.delta_high, point.kl_coef, point.rule) == ("hellinger", 0.2, 0.01, "mask")
    with pytest.raises(TypeError, match="GPPOTrainerConfig"):
        GPPOTrainer(model=tiny[0], reward_funcs=reward, args=GRPOConfig(output_dir=path, use_cpu=True))


def completion_logits(model, inputs, rows=slice(None)) -> torch.Tensor:
    """The model's full logits [B,T,V] at the completion tokens of `rows` (prompt and whole
    completion as context)."""
    completion_ids = inputs["completion_ids"][rows]
    input_ids = torch.cat([inputs["prompt_ids"][rows], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], dim=1)
    return model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_ids.size(1) + 1, use_cache=False
    ).logits[:, :-1]


class FullLogitsReference(GPPOTrainer):
    """The top-K passes computed from full [B,T,V] float32 logits (log_softmax of the model's own
    logits): the reference for GPPOTrainer's token_stats passes, which never make them."""

    def _completion_log_probs(self, model, inputs, rows=slice(None)):
        with self.accelerator.autocast():
            logits = completion_logits(model, inputs, rows)
        return torch.log_softmax(logits.float() / self.temperature, dim=-1)

    def _policy_topk(self, model, inputs):
        log_probs = self._completion_log_probs(model, inputs)
        logp, topk_logp = gppo.gather_logp(log_probs, inputs["completion_ids"], inputs["gppo_topk_ids"])
        return logp, topk_logp, -(log_probs.exp() * log_probs).sum(-1).detach()

    def _sampling_topk(self, output, rows):
        log_probs = self._completion_log_probs(self.model, output, rows)
        values, ids = log_probs.topk(self.gppo.rollout_top_k, dim=-1)
        return ids, values, log_probs.gather(-1, output["completion_ids"][rows, :, None]).squeeze(-1)


def small_chunks(monkeypatch, rows: int, vocab: int) -> None:
    """token_stats' default chunk (that of GPPOTrainer's top-K passes) at `rows` tokens."""
    monkeypatch.setattr(sys.modules["gppo.core.token_stats"], "CHUNK_ELEMENTS", rows * vocab)


@pytest.mark.parametrize("bf16", [False, True])
def test_topk_passes_equal_full_logits(tiny, monkeypatch, bf16):
    """GPPOTrainer's top-K passes (gppo.token_stats on the last hidden states, chunks of 3 tokens,
    through the model's own forward) against full float32 logits: the no-grad pass's top-K ids,
    values and sampled-token log-probs, then the training loss, every parameter's gradient and TRL's
    entropy metric. bf16=True: TRL's default autocast, whose bfloat16 logits both paths share."""
    fields = dict(gppo_preset="dppo-topk-tv", gppo_overrides={"top_k": 4}, bf16=bf16)
    ours = make_trainer(tiny, GPPOTrainer, GPPOTrainerConfig, **fields)
    reference = make_trainer(tiny, FullLogitsReference, GPPOTrainerConfig, **fields)
    small_chunks(monkeypatch, 3, len(tiny[1]))
    inputs = handcrafted_inputs(ours, tiny[1], 0.0, 0.0)
    valid = inputs["completion_mask"].bool()
    old = {}
    for trainer in (ours, reference):  # the old policy at temperature 0.3: ratios reach the mask
        trainer.temperature = 0.3
        with torch.no_grad():
            old[trainer] = trainer._sampling_topk(inputs, slice(None))
        trainer.temperature = 1.0
    (ids, values, logp), (ref_ids, ref_values, ref_logp) = old[ours], old[reference]
    assert torch.equal(ids[valid], ref_ids[valid])
    assert torch.allclose(values[valid], ref_values[valid], rtol=0, atol=1e-6)
    assert torch.allclose(logp[valid], ref_logp[valid], rtol=0, atol=1e-6)
    assert not ids[~valid].any() and not values[~valid].any() and not logp[~valid].any()
    inputs.update(gppo_topk_ids=ref_ids, gppo_topk_logp_old=ref_values, gppo_logp_old=ref_logp)

    loss, grads = loss_and_grads(ours, inputs)
    ref_loss, ref_grads = loss_and_grads(reference, inputs)
    assert 0 < ours._metrics["train"]["gppo/masked_frac"][-1] < 1
    assert max(g.abs().max() for g in ref_grads) > 0
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6), (loss, ref_loss)
    # float32: equal up to float32 rounding. bf16: autocast's backward of the output layer runs in
    # bfloat16, token_stats' accumulates the weight gradient in float32: equal up to bfloat16's 2**-8
    atol = 1e-2 * max(g.abs().max() for g in ref_grads) if bf16 else 1e-6
    for g, ref_g in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, ref_g, rtol=1e-5, atol=atol), (g - ref_g).abs().max()
    assert ours._metrics["train"]["entropy"][-1] == pytest.approx(reference._metrics["train"]["entropy"][-1], abs=1e-5)


# Tools: TRL's `tools` and `environment_factory` with the chat tokenizer of tests/trl_tools.py. The
# tool's results inside a completion have tool_mask 0: context for every forward, never a term.


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    trl_tools.save_chat_model(path / "model")
    return path


def make_tool_trainer(chat, trainer_cls, config_cls, source="tools", **fields):
    """A trainer whose model calls `multiply` (TRL's `tools`) or `Calculator().multiply` (TRL's
    `environment_factory`); a fresh tokenizer each time (TRL sets its response parser on it)."""
    args = config_cls(output_dir=str(chat / "out"), max_completion_length=96, **{**SETTINGS, **fields})
    tools = dict(tools=[trl_tools.multiply]) if source == "tools" else dict(environment_factory=trl_tools.Calculator)
    return trainer_cls(
        model=str(chat / "model"),
        reward_funcs=trl_tools.digits,
        args=args,
        processing_class=trl_tools.chat_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": trl_tools.prompts(4)}),
        **tools,
    )


def train_with_tools(trainer):
    with trl_tools.scripted_tool_calls(trainer):
        trainer.train()
    return trainer


def tool_positions(batch) -> torch.Tensor:
    """The completion tokens a tool wrote (completion_mask 1, tool_mask 0)."""
    return batch["completion_mask"].bool() & ~batch["tool_mask"].bool()


@pytest.mark.parametrize("source", ["tools", "environment_factory"])
def test_tool_run_matches_grpo_trainer(chat, source):
    """With tool results inside the completions, GPPOTrainer(ppo) logs GRPOTrainer(loss_type="dapo")'s
    losses and ends at its weights: the tool tokens are out of its ratios and of its token count."""
    trl = train_with_tools(make_tool_trainer(chat, GRPOTrainer, GRPOConfig, source))
    ours = train_with_tools(make_tool_trainer(chat, GPPOTrainer, GPPOTrainerConfig, source, gppo_preset="ppo"))
    batch = ours._buffered_inputs[0]
    tool, keep = tool_positions(batch), (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert tool.any()
    # each tool span is the product, as the tool returned it, and model tokens follow it
    tokenizer = ours.processing_class
    for row in tool.any(1).nonzero().flatten():
        text = tokenizer.decode(batch["completion_ids"][row][tool[row]])
        call = tokenizer.decode(batch["completion_ids"][row][: int(tool[row].int().argmax())])
        a, b = map(int, re.findall(r'"a": (\d+), "b": (\d+)', call)[0])
        assert f"<tool_response>\n{a * b}\n</tool_response>" in text
        assert keep[row, int(tool[row].nonzero().max()) + 1 :].any()
    if source == "environment_factory":
        assert sum(environment.calls for environment in ours.environments) == 3
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert logs[0]["tools/call_frequency"] == 0.75
    assert [h["loss"] for h in logs] == pytest.approx([h["loss"] for h in trl.state.log_history if "loss" in h])
    assert len(logs) == 2 and logs[1]["gppo/ratio/max"] > 1
    for p, trl_p in zip(final_parameters(ours), final_parameters(trl), strict=True):
        assert torch.allclose(p, trl_p, rtol=0, atol=1e-6), (p - trl_p).abs().max()


@pytest.fixture(scope="module")
def tool_batch(chat):
    """One generation batch of a top-K run with tool results in its completions."""
    trainer = make_tool_trainer(
        chat, GPPOTrainer, GPPOTrainerConfig, gppo_preset="dppo-topk-tv", gppo_overrides={"top_k": 4}, max_steps=1
    )
    return train_with_tools(trainer)._buffered_inputs[0]


def test_topk_pass_skips_tool_tokens(tool_batch):
    """The top-K pass scores the model's tokens as TRL's old-policy pass does and leaves the tool
    tokens at 0 (mu's top-K is never computed nor read there), which TRL's pass scores."""
    tool, model_tokens = tool_positions(tool_batch), (tool_batch["completion_mask"] * tool_batch["tool_mask"]).bool()
    assert tool.any() and model_tokens.any()
    old = tool_batch["old_per_token_logps"]
    assert torch.allclose(tool_batch["gppo_logp_old"][model_tokens], old[model_tokens], rtol=0, atol=1e-5)
    assert (old[tool] != 0).all()
    for name in ("gppo_logp_old", "gppo_topk_logp_old", "gppo_topk_ids"):
        assert not tool_batch[name][tool].any(), name
    assert (tool_batch["gppo_topk_logp_old"][model_tokens] < 0).all()


def cut_tool_tokens(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x [B,T,...] with each row's `keep` positions moved, in order, to its front and the rows cut to
    the longest count: the rollout with its tool spans cut out."""
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : int(keep.sum(1).max())]
    return x.gather(1, order.view(*order.shape, *[1] * (x.dim() - 2)).expand(*order.shape, *x.shape[2:]))


# preset: (GPPOTrainerConfig fields, the old policy's temperature): the policy is at temperature 1,
# so that each rule blocks some tokens (trm: sequences) but not all
TOOL_PRESETS = {
    "dppo-topk-kl": (dict(gppo_preset="dppo-topk-kl", gppo_overrides={"top_k": 4}), 0.25),
    "topp": (dict(gppo_preset="dppo-topk-tv", gppo_overrides={"top_k": 4, "estimator": "topp", "top_p": 0.05}), 0.25),
    "cppo": (dict(gppo_preset="cppo", gppo_overrides={"top_k": 4}), 0.25),
    "gspo": (dict(gppo_preset="gspo"), 0.25),
    "trm": (dict(gppo_preset="trm"), 0.4),
    "ppo+kl": (dict(gppo_preset="ppo", beta=0.04, use_bias_correction_kl=False), 0.25),
}


@pytest.mark.parametrize("name", list(TOOL_PRESETS))
def test_tool_tokens_are_no_term_of_the_loss(chat, tool_batch, name):
    """On a TRL batch with tool results in its completions, GPPOTrainer's loss, gradients and metrics
    equal gppo.policy_loss on the same rollout with the tool spans cut out (the policy's log-probs
    from full logits with the whole completion as context), while every per-token input at the tool
    positions is NaN (old and reference log-probs, mu's top-K log-probs; mu's top-K ids random)."""
    fields, old_temperature = TOOL_PRESETS[name]
    trainer = make_tool_trainer(chat, GPPOTrainer, GPPOTrainerConfig, bf16=False, **fields)
    cfg, model = trainer.gppo, trainer.model
    inputs = dict(tool_batch)
    keep, tool = (inputs["completion_mask"] * inputs["tool_mask"]).bool(), tool_positions(inputs)
    with torch.no_grad():
        old = torch.log_softmax(completion_logits(model, inputs).float() / old_temperature, -1)
        ref = torch.log_softmax(completion_logits(model, inputs).float() / 1.2, -1)
    topk_logp_old, topk_ids = old.topk(4, dim=-1)
    logp_old = old.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    logp_ref = ref.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)

    gen = torch.Generator().manual_seed(0)
    nan = torch.full_like(logp_old, torch.nan)
    inputs.update(
        old_per_token_logps=torch.where(tool, nan, logp_old),
        ref_per_token_logps=torch.where(tool, nan, logp_ref),
        gppo_logp_old=torch.where(tool, nan, logp_old),
        gppo_topk_logp_old=torch.where(tool[..., None], nan[..., None], topk_logp_old),
        gppo_topk_ids=torch.where(
            tool[..., None], torch.randint_like(topk_ids, len(trainer.processing_class), generator=gen), topk_ids
        ),
    )
    loss, grads = loss_and_grads(trainer, inputs)
    metrics = {k[5:]: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("gppo/")}

    model.zero_grad()
    log_probs = torch.log_softmax(completion_logits(model, inputs).float() / trainer.temperature, -1)
    logp = log_probs.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    cut = lambda x: cut_tool_tokens(x, keep)
    batch = gppo.TokenBatch(
        logp=cut(logp),
        logp_behavior=cut(logp_old),
        logp_old=cut(logp_old),
        advantages=inputs["advantages"],
        mask=cut(keep),
        token_ids=cut(inputs["completion_ids"]),
        topk_ids=cut(topk_ids) if cfg.rollout_top_k else None,
        topk_logp=cut(log_probs.gather(-1, topk_ids)) if cfg.rollout_top_k else None,
        topk_logp_behavior=cut(topk_logp_old) if cfg.rollout_top_k else None,
        topk_logp_old=cut(topk_logp_old) if cfg.rollout_top_k else None,
        logp_ref=cut(logp_ref),
    )
    ref_loss, ref_metrics = gppo.policy_loss(batch, cfg)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    assert 0 < metrics["masked_frac"] < 1, metrics
    assert max(g.abs().max() for g in ref_grads) > 0
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6), (loss - ref_loss).abs()
    for g, ref_g in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, ref_g, rtol=1e-5, atol=1e-6), (g - ref_g).abs().max()
    del ref_metrics["loss/policy"]
    assert metrics == pytest.approx(ref_metrics, rel=1e-5, abs=1e-6)
    entropy = -(log_probs.exp() * log_probs).sum(-1)[keep].mean()
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx(entropy.item(), rel=1e-5)
