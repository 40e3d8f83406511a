"""The training loop on a micro model: advantages, rewards, rollout tensors, a short run,
resume equivalence, and the errors a user can run into."""

import json
import math

import pytest
import torch
import yaml

import gppo
from gppo.advantages import group_advantages, informative_groups
from gppo.models.forward import policy_outputs
from gppo.models.loading import load_model_and_tokenizer
from gppo.problem import Problem
from gppo.rewards.pipeline import RewardPipeline, load_function, overlong_penalty
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.tasks import get_task
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.batch import rollout_from_generations, token_batch
from gppo.trainer.config import from_dict


def micro_config(model, out, **changes):
    values = dict(
        model=str(model),
        output_dir=str(out),
        steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=6,
        eval_size=8,
        eval_samples=2,
        eval_every=2,
        mini_batch_size=8,
        micro_batch_size=4,
        save_every=1,
        progress=False,
        threads=1,
        lr=1e-3,
    )
    values.update(changes)
    return from_dict(values)


# ------------------------------------------------------------------------------ advantages
def test_advantages_against_hand_computed_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    torch.testing.assert_close(
        group_advantages(rewards, "grpo", eps=0.0)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std
    )
    assert (group_advantages(rewards, "grpo")[1] == 0).all()
    torch.testing.assert_close(group_advantages(rewards, "dr_grpo")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # RLOO: reward minus the mean of the other three
    torch.testing.assert_close(
        group_advantages(rewards, "rloo")[0], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    )
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    expected = (centred - centred.mean()) / (centred.std() + 1e-6)
    torch.testing.assert_close(group_advantages(rewards, "reinforce++").flatten(), expected)
    assert informative_groups(rewards).tolist() == [True, False]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(rewards, "ppo")


# ------------------------------------------------------------------------------ rewards
def test_overlong_penalty_and_format_reward():
    assert overlong_penalty(10, 20, 5) == 0.0
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(18, 20, 5) == pytest.approx(-0.6)
    assert overlong_penalty(20, 20, 5) == -1.0
    assert overlong_penalty(20, 20, 0) == 0.0
    task = get_task("addition")
    problem = task.sample(__import__("random").Random(0))
    pipeline = RewardPipeline(
        lambda ps, cs: [task.score(p, c) for p, c in zip(ps, cs)],
        format_pattern=r"\d+",
        format_reward=0.1,
        max_length=6,
        overlong_buffer=2,
    )
    out = pipeline([problem, problem], [problem.answer, "x"], [[1] * 3, [1] * 6])
    assert out.accuracy == [1.0, 0.0]
    assert out.rewards == pytest.approx([1.1, -1.0])


def test_user_reward_functions_that_fail_count_warnings_and_give_zero():
    verifier = lambda ps, cs: [0.0] * len(cs)  # noqa: E731
    problems = [Problem("1+1=", "2")] * 4
    fns = [
        (name, load_function(f"tests.reward_fns:{name}"))
        for name in ("raises", "half_nan", "wrong_length", "length_bonus")
    ]
    pipeline = RewardPipeline(verifier, fns)
    with pytest.warns(RuntimeWarning, match="gave no finite reward"):
        out = pipeline(problems, ["2", "22", "3", ""], [[1, 2]] * 4)
    assert out.warnings == 4 + 2 + 4
    assert out.components["half_nan"] == [1.0, 0.0, 1.0, 0.0]
    assert out.rewards == pytest.approx([0.01 + 1, 0.02, 0.01 + 1, 0.0])
    with pytest.raises(ValueError, match="no function 'missing'"):
        load_function("tests.reward_fns:missing")
    with pytest.raises(ValueError, match="cannot import module"):
        load_function("no_such_module:fn")
    with pytest.raises(ValueError, match="reward_weights has 3 values"):
        RewardPipeline(verifier, fns[:1], weights=[1.0, 1.0, 1.0])


# ------------------------------------------------------------------------------ rollout tensors
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_forward_reproduces_the_rollout_log_probs(micro_model, temperature):
    """The trainer's layout (left-padded prompts, right-padded completions, position ids) gives
    back exactly the log-probs and top-K log-probs the engine recorded while sampling."""
    model, tokenizer = load_model_and_tokenizer(micro_model)
    engine = HFEngine(model, tokenizer, batch_size=16)
    prompts = ["1+2=", "345+678=", "9+99="]
    gens = engine.generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=8, n=3, top_k_logprobs=5, seed=1)
    )
    rollout = rollout_from_generations(gens, torch.zeros(len(gens)), tokenizer.pad_token_id, top_k=5)
    assert rollout.response_mask.sum(-1).tolist() == [len(g.completion_ids) for g in gens]
    with torch.no_grad():
        out = policy_outputs(model, rollout, temperature, return_log_probs=True)
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(out.logp[valid], rollout.logp_behavior[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.topk_logp[valid], rollout.topk_logp_behavior[valid], atol=1e-5, rtol=0)
    # the behaviour top-K ids are torch.topk of the same distribution
    top_ids = out.log_probs.topk(5, -1).indices
    assert (top_ids[valid] == rollout.topk_ids[valid]).all()
    # a sub-batch trimmed to its own columns gives the same values
    sub = rollout.select(torch.tensor([1, 4]))
    with torch.no_grad():
        sub_out = policy_outputs(model, sub, temperature)
    sub_valid = sub.response_mask.bool()
    torch.testing.assert_close(sub_out.logp[sub_valid], sub.logp_behavior[sub_valid], atol=1e-5, rtol=0)
    loss, metrics = gppo.policy_loss(token_batch(sub, sub_out), gppo.preset("dppo-topk-tv", top_k=5))
    assert torch.isfinite(loss) and metrics["masked_frac"] == 0.0


# ------------------------------------------------------------------------------ training
def test_three_step_run_writes_everything(micro_model, tmp_path):
    config = micro_config(
        micro_model,
        tmp_path / "run",
        preset="dppo-topk-kl",
        top_k=4,
        reward_funcs=["tests.reward_fns:length_bonus", "tests.reward_fns:raises"],
        reward_fn_max_failures=0,
    )
    with pytest.warns(RuntimeWarning):
        summary = Trainer(config).train()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    step = records[1]
    for key in (
        "rollout/reward_mean",
        "rollout/accuracy",
        "rollout/length_mean",
        "rollout/truncated_frac",
        "rollout/zero_variance_groups",
        "loss/masked_frac",
        "loss/entropy",
        "loss/divergence/mean",
        "optim/grad_norm",
        "perf/rollout_tokens_per_s",
    ):
        assert key in step, key
    assert any(k.startswith("loss/masked_frac/q[") for k in step)
    assert step["rollout/reward_fn_warnings"] == 16  # the raising function, for every sample
    assert "eval/greedy" in records[0] and "eval/greedy" in records[2] and "eval/greedy" in records[3]
    assert (run / "final" / "config.json").exists() and (run / "curves.png").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert len(list((run / "checkpoints").glob("step_*"))) == 2  # keep_checkpoints
    assert summary["before"]["eval/greedy"] == records[0]["eval/greedy"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["preset"] == "dppo-topk-kl" and saved["top_k"] == 4


@pytest.mark.parametrize(
    "preset,changes",
    [
        ("ppo", dict(anchor="old", kl_coef=0.05)),
        ("gspo", dict(advantage="rloo", dynamic_sampling=True)),
        (
            "dppo-binary-kl",
            dict(estimator="full", kl_coef=0.05, kl_estimator="full", loss_agg_mode="seq-mean-token-sum-norm"),
        ),
    ],
)
def test_options_run(micro_model, tmp_path, preset, changes):
    config = micro_config(micro_model, tmp_path / "run", preset=preset, steps=2, eval_every=0, save_every=0, **changes)
    Trainer(config).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2
    if changes.get("kl_coef"):
        assert "loss/kl_ref" in records[1]


def test_keep_checkpoints_0_deletes_them_once_the_run_has_finished(micro_model, tmp_path):
    """While training the newest checkpoint is kept (a kill can resume); the finished run keeps
    final/, its metrics and summary, but no resume state."""
    config = micro_config(micro_model, tmp_path / "run", steps=2, eval_every=0, save_every=1, keep_checkpoints=0)
    trainer = Trainer(config)
    assert trainer.train(stop_after=1) is None
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_000001"]
    Trainer.resume(tmp_path / "run").train()
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (tmp_path / "run" / "final" / "config.json").exists() and (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("skip", [False, True])
def test_an_update_without_gradient_moves_the_weights_only_when_not_skipped(micro_model, tmp_path, skip):
    """Step 1 has varying rewards, step 2 equal ones (gradient exactly 0): AdamW's momentum from step 1
    still moves the weights at step 2 unless skip_zero_gradient_updates is set."""
    from tests import reward_fns

    def final_weights(steps):
        reward_fns.varies_once.calls = 0
        trainer = Trainer(
            micro_config(
                micro_model,
                tmp_path / f"run{steps}",
                steps=steps,
                eval_every=0,
                save_every=0,
                epochs=1,
                reward_funcs=["tests.reward_fns:varies_once"],
                skip_zero_gradient_updates=skip,
            )
        )
        trainer.train()
        return [p.detach().clone() for p in trainer.model.parameters()], trainer.scheduler.last_epoch

    after_one, updates_one = final_weights(1)
    after_two, updates_two = final_weights(2)
    step_two = json.loads((tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step_two["optim/grad_norm"] == 0.0 and step_two["rollout/zero_variance_groups"] == 1.0
    unchanged = all(torch.equal(a, b) for a, b in zip(after_one, after_two))
    assert unchanged == skip
    assert updates_two == (updates_one if skip else 2 * updates_one)  # the lr schedule counts the updates taken


@pytest.mark.parametrize(
    "changes", [{}, dict(off_policy_steps=1, rollout_dtype="bfloat16", rollout_quantization="int8")]
)
def test_resume_reaches_the_same_parameters(micro_model, tmp_path, changes):
    """Also off-policy: the rollout sampled ahead at step 1 is restored from the checkpoint."""
    changes = dict(changes, reward_funcs=["tests.reward_fns:length_bonus"])  # rewards that vary: weights move
    full = Trainer(micro_config(micro_model, tmp_path / "full", **changes))
    initial = [p.detach().clone() for p in full.model.parameters()]
    full.train()
    assert any(not torch.equal(a, b) for a, b in zip(initial, full.model.parameters()))
    interrupted = Trainer(micro_config(micro_model, tmp_path / "resumed", **changes))
    assert interrupted.train(stop_after=1) is None
    resumed = Trainer.resume(tmp_path / "resumed", {"progress": False})
    assert resumed.step == 1
    assert len(resumed.pending.pending) == changes.get("off_policy_steps", 0)
    resumed.train()
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)

    def rollout_metrics(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [
            (r["step"], r.get("rollout/reward_mean"), r.get("loss/ratio/max"), r.get("mismatch/kl_k3")) for r in rows
        ]

    assert rollout_metrics(tmp_path / "full") == rollout_metrics(tmp_path / "resumed")


# ------------------------------------------------------------------------------ errors
def test_config_errors(micro_model, tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'lrr' \\(did you mean 'lr'\\?\\)"):
        from_dict({"lrr": 0.1})
    with pytest.raises(ConfigError, match="did you mean 'delta_high'"):
        from_dict({"delta_hihg": 0.1})
    with pytest.raises(ConfigError, match="unknown preset 'dppo-binary'"):
        from_dict({"preset": "dppo-binary"})
    with pytest.raises(ConfigError, match="task: 'adition' is not one of.*did you mean 'addition'"):
        micro_config(micro_model, tmp_path / "a", task="adition")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trainer(micro_config(tmp_path / "no-model", tmp_path / "b"))
    with pytest.raises(ConfigError, match="records at most"):
        Trainer(micro_config(micro_model, tmp_path / "c", preset="dppo-topk-tv", top_k=500))
    with pytest.raises(ConfigError, match="group_size must be >= 2 \\(got 1\\): advantages are relative"):
        micro_config(micro_model, tmp_path / "d", group_size=1)
    with pytest.raises(ConfigError, match="--data needs --model"):
        Trainer(from_dict({"data": "x.jsonl", "output_dir": str(tmp_path / "e")}))
    Trainer(micro_config(micro_model, tmp_path / "f", steps=1, eval_every=0)).train()
    with pytest.raises(ConfigError, match="already holds a run.*--resume"):
        Trainer(micro_config(micro_model, tmp_path / "f", steps=1))


def test_tokenizer_without_eos_is_refused(micro_model, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(micro_model, broken)
    config_file = broken / "tokenizer_config.json"
    data = json.loads(config_file.read_text())
    data["eos_token"] = None
    config_file.write_text(json.dumps(data))
    special = broken / "special_tokens_map.json"
    if special.exists():
        values = json.loads(special.read_text())
        values.pop("eos_token", None)
        special.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="no EOS token"):
        Trainer(micro_config(broken, tmp_path / "run"))


def test_cli_help_lists_every_field_and_rejects_typos(capsys):
    from gppo.cli import main
    from gppo.trainer.config import ALL_KEYS

    assert main(["train", "--help"]) == 0
    help_text = capsys.readouterr().out
    for key in ALL_KEYS:
        assert f"--{key}" in help_text, key
    assert main(["train", "--learning_rate", "0.1"]) == 2
    assert "gppo train: error: unknown option --learning_rate" in capsys.readouterr().err
    assert main(["train", "--delta-high", "0.1"]) == 2
    assert "did you mean --delta_high" in capsys.readouterr().err
    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    for name in gppo.PRESETS:
        assert name in listing
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_yaml_config_and_flag_precedence(tmp_path):
    import argparse

    from gppo.trainer.config import add_config_arguments, config_from_args

    path = tmp_path / "x.yaml"
    path.write_text("preset: dapo\nlr: 0.01\ndelta_high: 0.2\nsteps: 5\n")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(["--config", str(path), "--lr", "0.5", "--divergence", "kl"]))
    assert (config.preset, config.lr, config.steps) == ("dapo", 0.5, 5)
    assert config.gppo_config().delta_high == 0.2 and config.gppo_config().divergence == "kl"
    path.write_text("learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        config_from_args(parser.parse_args(["--config", str(path)]))


def test_gppo_eval_on_a_benchmark_file_and_on_a_task(micro_model, tmp_path, capsys):
    from gppo.cli import main

    out = tmp_path / "eval"
    fixture = "tests/fixtures/benchmarks/aime24.jsonl"
    args = [
        "eval",
        "--model",
        str(micro_model),
        "--benchmark",
        "aime24",
        "--data",
        fixture,
        "-n",
        "2",
        "--max_tokens",
        "4",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    assert (out / "summary.md").exists() and (out / "aime24.jsonl").exists()
    scored = len((out / "aime24.jsonl").read_text().splitlines())
    assert main(args) == 0  # resumable: nothing is generated again
    assert len((out / "aime24.jsonl").read_text().splitlines()) == scored
    assert main(["eval", "--model", str(micro_model), "--benchmark", "aime2024", "--data", fixture]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "--model",
                str(micro_model),
                "--task",
                "addition",
                "--eval_size",
                "8",
                "-n",
                "2",
                "--max_tokens",
                "4",
            ]
        )
        == 0
    )
    assert "eval/pass@2" in capsys.readouterr().out


def test_default_threads_counts_the_cores_busy_in_proc_stat(monkeypatch):
    """Two /proc/stat samples: 400 ticks of 4 cores pass, 100 of them idle or iowait -> 3 busy cores."""
    import builtins
    import io

    from gppo import threads as trainer_module

    samples = iter(["cpu  1000 0 500 8000 500 0 0 0 0 0\n", "cpu  1200 0 600 8080 520 0 0 0 0 0\n"])
    real_open = builtins.open
    monkeypatch.setattr(
        builtins,
        "open",
        lambda path, *a, **k: io.StringIO(next(samples)) if path == "/proc/stat" else real_open(path, *a, **k),
    )
    monkeypatch.setattr(trainer_module.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(trainer_module.os, "getloadavg", lambda: (3.9, 0.0, 0.0))  # not used when /proc/stat is read
    assert trainer_module._busy_cores(0.0) == pytest.approx(3.0)
    samples = iter(["cpu  1000 0 500 8000 500 0 0 0 0 0\n", "cpu  1010 0 500 8380 510 0 0 0 0 0\n"])
    assert trainer_module.default_threads(0.0) == 4  # 400 ticks, 390 idle: 0.1 busy core


# ------------------------------------------------------------------------------ memory knobs
def test_memory_knobs_change_the_update_only_by_rounding(micro_model, tmp_path):
    """The same rollout and initial weights: gradient checkpointing with a 2-token logits chunk
    (no prompt sharing), and bfloat16 mixed precision, give the default run's gradient (the first
    within float32 rounding, the second within bfloat16's)."""

    def gradient(name, **knobs):
        trainer = Trainer(
            micro_config(
                micro_model,
                tmp_path / name,
                mini_batch_size=16,
                epochs=1,
                **knobs,
                reward_funcs=["tests.reward_fns:length_bonus"],
            )
        )
        checkpointing = knobs.get("gradient_checkpointing", False)
        assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules()) == checkpointing
        assert trainer.forward_options.share_prompt == (not checkpointing)
        grads = []  # the gradient the one optimizer step of the update applies
        trainer.optimizer.register_step_pre_hook(
            lambda *_: grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
        )
        trainer.update(trainer.prepare(rollout))
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters()) and len(grads) == 1
        return grads[0]

    sampler = Trainer(micro_config(micro_model, tmp_path / "sampler", reward_funcs=["tests.reward_fns:length_bonus"]))
    rollout = sampler.rollout()[0]
    default = gradient("default")
    checkpointed = gradient("checkpointed", gradient_checkpointing=True, logits_chunk_size=2)
    mixed = gradient("mixed", mixed_precision="bf16")
    assert default.abs().max() > 0
    torch.testing.assert_close(checkpointed, default, rtol=0, atol=1e-5 * default.abs().max().item())
    assert torch.nn.functional.cosine_similarity(mixed, default, dim=0) > 0.99
    assert not torch.equal(mixed, default)


def test_mini_batches_hold_whole_groups():
    from gppo.trainer.update_steps import shuffled_groups

    order = shuffled_groups(24, 4, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(24))
    groups = order.view(6, 4)
    assert (groups // 4 == groups[:, :1] // 4).all() and (groups % 4 == torch.arange(4)).all()
    assert groups[:, 0].tolist() != sorted(groups[:, 0].tolist())  # the groups are shuffled


def test_precision_defaults_follow_the_device(monkeypatch):
    """--mixed_precision auto and unset --tf32 / --rollout_dtype: float32 throughout on a CPU (the
    README's numbers reproduce to the digit), bfloat16 autocast and TF32 on a CUDA GPU of compute
    capability 8.0+ (float32 weights and AdamW), no autocast on an older one; vLLM samples in
    bfloat16 on a GPU. Explicit choices win; TF32 asked for on a CPU is refused."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    config = from_dict({})
    assert (config.mixed_precision, config.tf32, config.rollout_dtype) == ("auto", None, None)
    assert config.resolved_mixed_precision(cpu) == "no" and config.forward_options(cpu).autocast is None
    assert not config.uses_tf32(cpu) and config.sampling_dtype(cpu) == "float32"
    assert config.resolved_mixed_precision(gpu) == "bf16" and config.forward_options(gpu).autocast == torch.bfloat16
    assert config.uses_tf32(gpu) and config.sampling_dtype(gpu) == "float32"  # hf samples from the weights
    capability["value"] = (7, 5)
    assert config.resolved_mixed_precision(gpu) == "no"
    capability["value"] = (9, 0)
    vllm = from_dict({})
    vllm.engine = "vllm"  # (vLLM is not installed here: only the choice of dtype is tested)
    assert vllm.sampling_dtype(gpu) == "bfloat16" and vllm.sampling_dtype(cpu) == "float32"
    vllm.rollout_dtype = "float32"
    assert vllm.sampling_dtype(gpu) == "float32"
    explicit = from_dict({"mixed_precision": "no", "tf32": False})
    assert explicit.resolved_mixed_precision(gpu) == "no" and not explicit.uses_tf32(gpu)
    assert from_dict({"mixed_precision": "bf16"}).resolved_mixed_precision(cpu) == "bf16"
    assert from_dict({"dtype": "bfloat16"}).resolved_mixed_precision(gpu) == "no"  # pure bf16 training
    with pytest.raises(ConfigError, match="tf32 true selects TF32 matmuls on a CUDA GPU, but this run is on cpu"):
        from_dict({"tf32": True, "device": "cpu"})
