"""Training-inference mismatch knobs of the trainer: the rollout copy (dtype, int8 weights), the
off-policy queue, and the mismatch metrics against hand-computed and float64 references."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

import gppo.trainer.logging
import gppo.trainer.trainer
from gppo.models.forward import policy_outputs
from gppo.models.loading import load_model_and_tokenizer
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.batch import Rollout
from gppo.trainer.rollout_policy import OffPolicyQueue, RolloutPolicy, fake_quantize_int8, mismatch_metrics
from tests.test_trainer import micro_config

LEARNS = dict(reward_funcs=["tests.reward_fns:length_bonus"])  # rewards that vary, so the weights move


def token_rollout(logp_behavior, logp_old, mask, tag=0.0):
    """A Rollout holding only what the mismatch metrics and the queue read ([N, T] tensors)."""
    n, t = logp_behavior.shape
    zeros = torch.zeros((n, t), dtype=torch.long)
    return Rollout(
        input_ids=zeros,
        attention_mask=zeros,
        prompt_length=1,
        response_mask=mask,
        token_ids=zeros,
        logp_behavior=logp_behavior,
        advantages=torch.full((n,), tag),
        logp_old=logp_old,
    )


# ------------------------------------------------------------------------------ int8 weights
def test_int8_fake_quantization_against_hand_computed_values():
    linear = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        linear.weight.copy_(
            torch.tensor(
                [
                    [1.27, 0.333, -0.0061],  # s = 0.01: 33.3 -> 33, -0.61 -> -1
                    [0.0, 0.0, 0.0],  # a zero row stays zero
                    [2.54, 1.011, -0.035],
                ]
            )
        )  # s = 0.02: 50.55 -> 51, -1.75 -> -2
    expected = torch.tensor([[1.27, 0.33, -0.01], [0.0, 0.0, 0.0], [2.54, 1.02, -0.04]])
    torch.testing.assert_close(fake_quantize_int8(linear.weight), expected, atol=1e-6, rtol=0)


def test_int8_rollout_copy_quantizes_every_linear_but_keeps_embeddings_and_head(micro_model):
    model, _ = load_model_and_tokenizer(micro_model)
    policy = RolloutPolicy(model, torch.float32, "int8")
    assert policy.is_copy and policy.model is not model
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 8  # q k v o gate up down, and the head (tied to the embeddings)
    copied, quantized = dict(policy.model.named_parameters()), 0
    for name, source in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in linears:
            quantized += 1
            q = copied[name]
            assert not torch.equal(q, source), name
            scale = source.detach().double().abs().amax(1, keepdim=True) / 127
            levels = q.double() / scale
            torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)  # integers in [-127, 127]
            assert levels.abs().max() <= 127 + 1e-4
            assert (q - source).abs().max() <= scale.max() / 2 + 1e-7  # round to nearest
        else:  # embeddings (tied to the head), norms, biases
            assert torch.equal(copied[name], source), name
    assert quantized == 7


# ------------------------------------------------------------------------------ mismatch metrics
def test_mismatch_metrics_against_hand_computed_values():
    mu = torch.tensor([[0.5, 0.2, 0.3]]).log()
    old = torch.tensor([[0.25, 0.4, float("nan")]]).log()  # the padded third token is never read
    metrics = mismatch_metrics(token_rollout(mu, old, torch.tensor([[1.0, 1.0, 0.0]])))
    log2 = math.log(2)
    expected = {
        "mismatch/prob_diff/mean": 0.225,
        "mismatch/prob_diff/max": 0.25,
        "mismatch/kl_sample": 0.0,  # (log 2 - log 2) / 2
        "mismatch/kl_k3": ((0.5 - 1 + log2) + (2 - 1 - log2)) / 2,  # r - 1 - log r at r = 1/2, 2
        "mismatch/ratio/q0.01": 0.5 + 0.01 * 1.5,
        "mismatch/ratio/q0.5": 1.25,
        "mismatch/ratio/q0.99": 0.5 + 0.99 * 1.5,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    assert mismatch_metrics(token_rollout(mu, None, torch.ones(1, 3))) == {}


@pytest.mark.parametrize("scale", [0.3, 1e-5])
def test_mismatch_metrics_against_float64_references_from_float32_inputs(scale):
    """Random gaps and tiny ones (bf16-like): k3 = e^d - 1 - d must not cancel to 0 or noise."""
    gen = torch.Generator().manual_seed(0)
    mu = torch.log_softmax(torch.randn(64, 50, 20, generator=gen), -1)[..., 0]
    old = mu + scale * torch.randn(mu.shape, generator=gen)
    mask = (torch.rand(mu.shape, generator=gen) < 0.8).float()
    metrics = mismatch_metrics(token_rollout(mu, old, mask))
    valid = mask.bool().numpy()
    m, o = mu.numpy().astype(np.float64)[valid], old.numpy().astype(np.float64)[valid]
    d = o - m
    if scale < 1e-3:  # Taylor series of e^d - 1 - d, error below d^5 / 120
        k3 = np.mean(d**2 / 2 + d**3 / 6 + d**4 / 24)
    else:
        k3 = np.mean(np.exp(d) - 1 - d)
    gap = np.abs(np.exp(o) - np.exp(m))
    ratio = np.exp(d)
    assert metrics["mismatch/kl_k3"] == pytest.approx(k3, rel=1e-9)
    assert metrics["mismatch/kl_sample"] == pytest.approx(np.mean(m - o), rel=1e-9)
    assert metrics["mismatch/prob_diff/mean"] == pytest.approx(gap.mean(), rel=1e-9)
    assert metrics["mismatch/prob_diff/max"] == pytest.approx(gap.max(), rel=1e-9)
    for q in (0.01, 0.5, 0.99):
        assert metrics[f"mismatch/ratio/q{q:g}"] == pytest.approx(np.quantile(ratio, q), rel=1e-12)


# ------------------------------------------------------------------------------ the queue
def next_from(queue: OffPolicyQueue, step: int, sample):
    """What the trainer does at `step` (Trainer._next_rollout, without a background thread)."""
    for target, _ in queue.due(step):
        queue.put(target, step, *sample(target))
    return queue.take(step)


@pytest.mark.parametrize("k", [1, 3])
def test_queue_serves_the_batch_sampled_k_steps_earlier_and_survives_a_state_round_trip(k):
    version = {"weights": 0}  # the step whose weights are loaded

    def sample(target):
        stats = {"sampled_with": version["weights"]}
        return token_rollout(torch.zeros(1, 1), None, torch.ones(1, 1), tag=float(target)), stats

    queue = OffPolicyQueue(k)
    for t in range(6):
        if t == 3:  # checkpoint and restore mid-run
            restored = OffPolicyQueue(k)
            restored.load_state_dict(queue.state_dict())
            queue = restored
        rollout, stats = next_from(queue, t, sample)
        assert rollout.advantages.item() == t  # the batch of step t ...
        assert stats["sampled_with"] == max(0, t - k)  # ... sampled by the weights of step t - k
        assert stats["mismatch/policy_lag"] == min(t, k)
        assert len(queue.pending) == k
        version["weights"] += 1  # the update of step t
    if k:  # a queue restored into another run's step
        with pytest.raises(RuntimeError, match="do not belong to this run"):
            next_from(queue, 2, sample)


# ------------------------------------------------------------------------------ the trainer
def count_forwards(monkeypatch):
    calls = []
    original = gppo.trainer.trainer.policy_outputs
    monkeypatch.setattr(
        gppo.trainer.trainer, "policy_outputs", lambda *a, **kw: calls.append(a[0]) or original(*a, **kw)
    )
    return calls


def test_without_a_knob_the_engine_samples_the_trained_weights_and_pi_old_is_not_recomputed(
    micro_model, tmp_path, monkeypatch
):
    trainer = Trainer(micro_config(micro_model, tmp_path / "run", steps=1, eval_every=0, save_every=0))
    assert not trainer.rollout_policy.is_copy
    assert trainer.engine.model is trainer.rollout_policy.model is trainer.model
    calls = count_forwards(monkeypatch)
    rollout, _ = trainer.rollout()
    assert trainer.prepare(rollout).logp_old is None and calls == []
    metrics = trainer.train_step()
    assert "loss/masked_frac" in metrics and not any(k.startswith("mismatch/") for k in metrics)


def test_bf16_rollout_copy_is_refreshed_in_place_and_its_mismatch_is_measured(micro_model, tmp_path, monkeypatch):
    trainer = Trainer(
        micro_config(
            micro_model, tmp_path / "run", steps=2, eval_every=0, save_every=0, rollout_dtype="bfloat16", **LEARNS
        )
    )
    copy = trainer.rollout_policy.model
    assert trainer.engine.model is copy and copy is not trainer.model
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert any(not torch.equal(c.float(), p) for c, p in zip(copy.parameters(), trainer.model.parameters()))
    storage = [p.data_ptr() for p in copy.parameters()]

    calls = count_forwards(monkeypatch)
    rollout, _ = trainer.rollout()
    trainer.prepare(rollout)
    micro_batches = math.ceil(rollout.size / trainer.config.micro_batch_size)
    assert calls == [trainer.model] * micro_batches  # pi_old once per batch, with the trained weights
    with torch.no_grad():
        mu = policy_outputs(copy, rollout, trainer.config.temperature).logp
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(mu[valid], rollout.logp_behavior[valid], atol=1e-5, rtol=0)  # sampled by the copy

    figures = []
    monkeypatch.setattr(gppo.trainer.logging, "save_figure", lambda fig, path: figures.append(fig) or path)
    trainer.train()
    for c, p in zip(copy.parameters(), trainer.model.parameters()):  # refreshed after the last update
        assert torch.equal(c, p.detach().to(torch.bfloat16))
    assert [p.data_ptr() for p in copy.parameters()] == storage  # copied into, not re-allocated

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records[1:]:
        assert record["mismatch/prob_diff/max"] >= record["mismatch/prob_diff/mean"] > 0
        assert record["mismatch/kl_k3"] > 0 and math.isfinite(record["mismatch/kl_sample"])
        assert record["mismatch/ratio/q0.01"] < 1 < record["mismatch/ratio/q0.99"]
        assert "mismatch/policy_lag" not in record  # off_policy_steps = 0
    titles = [ax.get_title() for ax in figures[0].axes if ax.get_visible()]
    assert {"mismatch: KL(mu || pi_old)", "mismatch: |pi_old(a) - mu(a)|", "mismatch: pi_old(a) / mu(a)"} <= set(titles)


def test_full_estimator_reads_mu_from_the_rollout_copy_and_pi_old_from_the_trained_weights(micro_model, tmp_path):
    trainer = Trainer(
        micro_config(micro_model, tmp_path / "run", preset="dppo-binary-kl", estimator="full", rollout_dtype="bfloat16")
    )
    rollout, _ = trainer.rollout()
    prepared = trainer.prepare(rollout)
    with torch.no_grad():
        copy = policy_outputs(trainer.rollout_policy.model, rollout, 1.0, return_log_probs=True)
        trained = policy_outputs(trainer.model, rollout, 1.0, return_log_probs=True)
    assert torch.equal(prepared.logp_behavior_full, copy.log_probs)
    assert torch.equal(prepared.logp_old, trained.logp)
    assert not torch.equal(copy.log_probs, trained.log_probs)


@pytest.mark.parametrize("objective", [{}, dict(preset="dppo-binary-kl", estimator="full")], ids=["default", "full"])
def test_off_policy_batches_were_sampled_by_the_saved_weights_of_step_t_minus_k(micro_model, tmp_path, objective):
    """... and with estimator 'full', mu's whole distribution is that of the weights of step t - k too."""
    k = 2
    trainer = Trainer(
        micro_config(
            micro_model,
            tmp_path / "run",
            steps=4,
            eval_every=0,
            save_every=1,
            keep_checkpoints=10,
            off_policy_steps=k,
            **objective,
            **LEARNS,
        )
    )
    trained = []
    update = trainer.update
    trainer.update = lambda rollout: trained.append((trainer.step, rollout)) or update(rollout)
    trainer.train()
    assert [t for t, _ in trained] == [0, 1, 2, 3]
    assert len(trainer.pending.pending) == k  # sampled ahead for steps 4 and 5, kept in the checkpoint

    def weights(step):
        path = micro_model if step == 0 else tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
        return load_model_and_tokenizer(path)[0]

    for t, rollout in trained:
        rollout = rollout.select(torch.arange(rollout.size))
        valid = rollout.response_mask.bool()
        with torch.no_grad():
            sampler_outputs = policy_outputs(weights(max(0, t - k)), rollout, 1.0, return_log_probs=True)
            sampler, current = sampler_outputs.logp, policy_outputs(weights(t), rollout, 1.0).logp
        torch.testing.assert_close(sampler[valid], rollout.logp_behavior[valid], atol=1e-5, rtol=0)
        if objective:
            torch.testing.assert_close(
                rollout.logp_behavior_full[valid], sampler_outputs.log_probs[valid], atol=1e-5, rtol=0
            )
        else:
            assert rollout.logp_behavior_full is None
        torch.testing.assert_close(current[valid], rollout.logp_old[valid], atol=1e-5, rtol=0)
        if t >= 1:  # the weights moved since: the batch is off-policy
            assert (current - sampler)[valid].abs().max() > 1e-3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mismatch/policy_lag"] for r in records[1:]] == [0, 1, 2, 2]
    assert records[1]["mismatch/prob_diff/max"] < 1e-5 < records[2]["mismatch/prob_diff/max"]


NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="engine 'vllm' is refused earlier, for not being installed"
)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(rollout_dtype="fp8"), "rollout_dtype: 'fp8' is not one of \\['float32', 'bfloat16', 'float16'\\]"),
        (dict(rollout_quantization="int4"), "rollout_quantization: 'int4' is not one of \\['none', 'int8'\\]"),
        (dict(off_policy_steps=-1), "off_policy_steps must be >= 0 \\(got -1\\)"),
        pytest.param(
            dict(engine="vllm", rollout_quantization="int8"),
            "engine 'vllm' samples with its own weights",
            marks=NEEDS_VLLM,
        ),
        (dict(rollout_overlap=True), "needs off_policy_steps >= 1 \\(got 0\\)"),
    ],
)
def test_bad_mismatch_knobs_are_refused_with_the_field_and_the_fix(micro_model, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(micro_config(micro_model, tmp_path / "run", **changes))


def test_background_rollouts_give_the_same_run_as_sequential_ones(micro_model, tmp_path):
    """rollout_overlap only moves the sampling of step t+k into a thread that runs during step t's
    update (from a copy of the step-t weights): parameters and logged batches are identical."""
    runs = {}
    for overlap in (False, True):
        trainer = Trainer(
            micro_config(
                micro_model,
                tmp_path / str(overlap),
                eval_every=0,
                save_every=0,
                off_policy_steps=1,
                rollout_overlap=overlap,
                **LEARNS,
            )
        )
        assert trainer.rollout_policy.is_copy == overlap
        trainer.train()
        rows = [json.loads(line) for line in (tmp_path / str(overlap) / "metrics.jsonl").read_text().splitlines()]
        runs[overlap] = (trainer.model, [(r.get("rollout/reward_mean"), r.get("mismatch/kl_k3")) for r in rows])
    for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters()):
        assert torch.equal(a, b)
    assert runs[False][1] == runs[True][1]
