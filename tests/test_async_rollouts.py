"""Asynchronous rollouts (gppo.trainer.async_rollouts): the synchronous run at staleness 0, each
token's mu under the weights of its recorded version, the staleness bound under a slow trainer,
tool rollouts, resume, metrics and refusals."""

import copy
import json
import time

import pytest
import torch

from gppo.models.loading import load_model_and_tokenizer
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.async_rollouts import staleness_metrics
from gppo.trainer.batch import Rollout
from gppo.trainer.config import from_dict
from tests.test_trainer import micro_config

LEARNS = dict(reward_funcs=["tests.reward_fns:length_bonus"])  # rewards that vary, so the weights move


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def record_trained(trainer, delay_s: float = 0.0) -> list[tuple[int, Rollout]]:
    """Wrap `trainer.update` to keep (step, rollout) of every update, after sleeping `delay_s`."""
    trained, update = [], trainer.update

    def slowed(rollout):
        time.sleep(delay_s)
        trained.append((trainer.step, rollout))
        return update(rollout)

    trainer.update = slowed
    return trained


def test_staleness_zero_reproduces_the_synchronous_run_bit_for_bit(micro_model, tmp_path):
    """--async_rollouts --max_staleness 0: the worker starts wave t once version t is loaded, so each
    batch is sampled by the weights the synchronous run samples it with, in another thread: metrics
    (but timings and the staleness/ block) and final weights are identical."""
    runs = {}
    for name, changes in (("sync", {}), ("async", dict(async_rollouts=True, max_staleness=0))):
        trainer = Trainer(micro_config(micro_model, tmp_path / name, steps=4, save_every=0, **LEARNS, **changes))
        assert not trainer.rollout_policy.is_copy  # nothing samples while the weights change
        trainer.train()
        runs[name] = (trainer.model, metrics_rows(tmp_path / name))
    for a, b in zip(runs["sync"][0].parameters(), runs["async"][0].parameters()):
        assert torch.equal(a, b)
    sync_rows, async_rows = runs["sync"][1], runs["async"][1]
    assert len(sync_rows) == len(async_rows) == 5
    for s, a in zip(sync_rows, async_rows):
        shared = {k for k in s if not k.startswith("perf/") and k != "time"}
        assert {k: s[k] for k in shared} == {k: a[k] for k in shared}
        if "loss/masked_frac" in a:
            assert a["staleness/token_max"] == a["staleness/sample_max"] == 0
    assert any("loss/masked_frac" in r for r in async_rows)


def perturbed(model, seed: int, scale: float = 0.05) -> dict:
    """A state dict of `model`'s weights plus seeded noise: another policy version."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_each_tokens_mu_is_the_log_prob_under_its_recorded_version(micro_model, top_p):
    """The engine loads new weights between decoding steps (versions 1 and 2 at steps 2 and 4): every
    recorded log mu(a_t) equals the log-prob of a_t under the weights of its recorded version,
    recomputed from scratch by a full forward of prompt + completion, in float32, including the
    completions that span three versions (the KV cache of the tokens before a switch is recomputed)."""
    model, tokenizer = load_model_and_tokenizer(micro_model, torch.float32)
    versions = [copy.deepcopy(model.state_dict()), perturbed(model, 1), perturbed(model, 2)]
    engine = HFEngine(model, tokenizer, batch_size=16)
    calls = []

    def policy_version() -> int:  # called before each forward that gives a token's logits
        calls.append(None)
        version = 0 if len(calls) <= 2 else 1 if len(calls) <= 4 else 2
        model.load_state_dict(versions[version])
        return version

    params = SamplingParams(
        temperature=1.0, top_p=top_p, max_new_tokens=8, n=4, seed=0, record_kept_ids=True, policy_version=policy_version
    )
    gens = engine.generate(["12+34=", "5+6=", "100+200="], params)
    spanning = 0
    for g in gens:
        assert len(g.versions) == len(g.completion_ids)
        spanning += len(set(g.versions)) == 3
        ids = torch.tensor([g.prompt_ids + g.completion_ids])
        for t, (token, version, logp) in enumerate(zip(g.completion_ids, g.versions, g.logprobs)):
            model.load_state_dict(versions[version])
            with torch.no_grad():
                logits = model(ids[:, : len(g.prompt_ids) + t]).logits[0, -1].float()
            full = torch.log_softmax(logits, -1)
            if top_p < 1:  # the recorded mu is the nucleus's renormalised distribution
                full = full - full[torch.tensor(g.kept_ids[t])].logsumexp(0)
            assert abs(full[token].item() - logp) < 2e-5, (t, version)
    assert spanning >= 6  # most completions run past step 4


def test_a_partial_rollout_without_recomputing_its_cache_would_record_other_log_probs(micro_model):
    """The check above has teeth: the same switch of weights while the cache of the earlier tokens is
    kept gives log-probs off by far more than its tolerance."""
    model, tokenizer = load_model_and_tokenizer(micro_model, torch.float32)
    new = perturbed(model, 1, scale=0.2)
    engine = HFEngine(model, tokenizer, batch_size=16)
    ids = tokenizer("12+34=")["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), use_cache=True)
        model.load_state_dict(new)
        stale = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values).logits[0, -1]
        fresh = model(torch.tensor([ids])).logits[0, -1]
    assert (torch.log_softmax(stale, -1) - torch.log_softmax(fresh, -1)).abs().max() > 1e-3
    assert engine.max_top_k_logprobs == model.config.vocab_size


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_sample_older_than_max_staleness_is_trained_on_with_a_slowed_trainer(
    micro_model, tmp_path, partial, max_staleness
):
    """A trainer slowed to 0.3 s per update: the worker runs ahead as far as the bound lets it, and
    every trained token was sampled at most max_staleness versions before its update (the bound is
    reached, so the test is not vacuous)."""
    trainer = Trainer(
        micro_config(
            micro_model,
            tmp_path / "run",
            steps=5,
            eval_every=0,
            save_every=0,
            async_rollouts=True,
            max_staleness=max_staleness,
            partial_rollouts=partial,
            **LEARNS,
        )
    )
    assert trainer.rollout_policy.is_copy  # the engine samples while the weights change
    trained = record_trained(trainer, delay_s=0.3)
    trainer.train()
    lags = [step - int(rollout.versions[rollout.response_mask.bool()].min()) for step, rollout in trained]
    assert len(trained) == 5 and max(lags) == max_staleness
    rows = [r for r in metrics_rows(tmp_path / "run") if "staleness/token_max" in r]
    assert len(rows) == 5 and all(r["staleness/sample_max"] <= max_staleness for r in rows)
    assert all(0 <= r["staleness/engine_idle_frac"] <= 1 and 0 <= r["staleness/trainer_idle_frac"] <= 1 for r in rows)
    assert any(k.startswith("staleness/mismatch_kl_k3/lag") for k in rows[-1])


def test_at_its_bound_asynchronous_sampling_is_the_fixed_lag_bit_for_bit(micro_model, tmp_path):
    """With the trainer slowed (0.3 s per update) the worker waits at the bound, so without partial
    rollouts wave t is sampled by exactly version t - 2, from the same prompts and seeds as
    --off_policy_steps 2 samples step t's batch: the two runs log the same rewards and end with the
    same weights, bit for bit (one thread each: the asynchronous run would halve two)."""
    runs = {}
    for name, changes in (
        ("fixed-lag", dict(off_policy_steps=2)),
        ("async", dict(async_rollouts=True, max_staleness=2)),
    ):
        trainer = Trainer(
            micro_config(
                micro_model, tmp_path / name, steps=5, eval_every=0, save_every=0, threads=1, **changes, **LEARNS
            )
        )
        record_trained(trainer, delay_s=0.3 if name == "async" else 0.0)
        trainer.train()
        rewards = [r["rollout/reward_mean"] for r in metrics_rows(tmp_path / name) if "rollout/reward_mean" in r]
        runs[name] = (trainer.model, rewards)
    for (key, a), b in zip(runs["fixed-lag"][0].named_parameters(), runs["async"][0].parameters()):
        assert torch.equal(a, b), key
    assert runs["fixed-lag"][1] == runs["async"][1] and len(runs["async"][1]) == 5


def test_partial_rollouts_mix_versions_within_a_completion(micro_model, tmp_path):
    """With the engine slowed (10 ms per decoding step) the trainer's new weights land mid-batch:
    some trained completion holds tokens of two versions, each token's recorded version is one the
    engine loaded, and staleness/versions_per_completion_max says so."""
    trainer = Trainer(
        micro_config(
            micro_model,
            tmp_path / "run",
            steps=4,
            max_new_tokens=12,
            eval_every=0,
            save_every=0,
            async_rollouts=True,
            max_staleness=2,
            partial_rollouts=True,
            **LEARNS,
        )
    )
    gate = trainer.async_rollouts.gate
    boundary = gate.boundary

    def slowly(load: bool = True) -> int:  # before every decoding step
        time.sleep(0.01)
        return boundary(load)

    gate.boundary = slowly
    trained = record_trained(trainer)
    trainer.train()
    spans = [len(set(v[m.bool()].tolist())) for _, r in trained for v, m in zip(r.versions, r.response_mask)]
    assert max(spans) >= 2
    rows = [r for r in metrics_rows(tmp_path / "run") if "staleness/versions_per_completion_max" in r]
    assert max(r["staleness/versions_per_completion_max"] for r in rows) >= 2


def test_staleness_metrics_against_hand_counts():
    """Step 5, two samples: versions (5, 4, pad) and (3, 3, 4): tokens 0,1 / 2,2,1 behind; samples 1
    and 2 behind (their oldest token); 2 versions in each completion."""
    versions = torch.tensor([[5, 4, 0], [3, 3, 4]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    zeros = torch.zeros((2, 3))
    rollout = Rollout(zeros.long(), zeros.long(), 1, mask, zeros.long(), zeros, torch.zeros(2), versions=versions)
    m = staleness_metrics(rollout, 5)
    assert (m["staleness/token_min"], m["staleness/token_max"]) == (0, 2)
    assert m["staleness/token_mean"] == pytest.approx(6 / 5)
    assert (m["staleness/sample_min"], m["staleness/sample_mean"], m["staleness/sample_max"]) == (1, 1.5, 2)
    assert m["staleness/versions_per_completion_mean"] == m["staleness/versions_per_completion_max"] == 2


def test_a_resumed_run_at_staleness_zero_is_exact_and_at_staleness_one_finishes(micro_model, tmp_path):
    """Checkpoints hold where the first wave not trained on began: at staleness 0 a run stopped after
    step 2 and resumed equals the uninterrupted one; at staleness 1 (the wave sampled ahead is dropped
    and sampled again from the same prompts) it runs to its last step."""
    for staleness in (0, 1):
        changes = dict(steps=4, eval_every=0, async_rollouts=True, max_staleness=staleness, **LEARNS)
        whole = Trainer(micro_config(micro_model, tmp_path / f"whole{staleness}", **changes))
        whole.train()
        part = Trainer(micro_config(micro_model, tmp_path / f"part{staleness}", **changes))
        assert part.train(stop_after=2) is None
        resumed = Trainer.resume(tmp_path / f"part{staleness}")
        assert resumed.step == 2
        resumed.train()
        rows = metrics_rows(tmp_path / f"part{staleness}")
        assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
        if staleness == 0:
            for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
                assert torch.equal(a, b)


def test_tool_rollouts_run_asynchronously_with_their_mask(tmp_path):
    """The multiplication warm start calls the python tool: asynchronous partial rollouts carry the
    tool's tokens as context (response mask 0), and staleness counts the model's tokens only."""
    trainer = Trainer(
        from_dict(
            dict(
                task="multiplication",
                tools=["python"],
                steps=2,
                prompts_per_step=4,
                group_size=4,
                eval_every=0,
                save_every=0,
                async_rollouts=True,
                max_staleness=1,
                partial_rollouts=True,
                async_batching="waves",
                output_dir=str(tmp_path / "run"),
                progress=False,
                threads=1,
            )
        )
    )
    trained = record_trained(trainer)
    trainer.train()
    rollout = trained[0][1]
    model_tokens = rollout.response_mask.bool()
    written = rollout.attention_mask[:, rollout.prompt_length :].bool()
    assert (written & ~model_tokens).any()  # tool output tokens, never trained
    assert rollout.versions.shape == rollout.token_ids.shape
    rows = [r for r in metrics_rows(tmp_path / "run") if "rollout/tool_calls_mean" in r]
    assert rows and rows[0]["rollout/tool_calls_mean"] > 0 and "staleness/token_mean" in rows[0]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(max_staleness=-1), "max_staleness"),
        (dict(max_staleness=2), "--max_staleness 2 would be ignored: it applies with --async_rollouts true"),
        (dict(partial_rollouts=True), "--partial_rollouts true would be ignored: it applies with --async_rollouts"),
        (dict(vllm_own_process=True), "--vllm_own_process true would be ignored: it applies with --engine vllm"),
        (dict(async_rollouts=True, off_policy_steps=1), "--off_policy_steps 1 trains on .* use one of them"),
        (dict(async_rollouts=True, rollout_overlap=True), "--rollout_overlap true trains on"),
        (
            dict(
                async_rollouts=True, partial_rollouts=True, estimator="full", anchor="behavior", async_batching="waves"
            ),
            "spans several versions: use --anchor old",
        ),
        (
            dict(async_rollouts=True, estimator="full", anchor="behavior"),
            "come from several versions: use --async_batching waves, --anchor old",
        ),
        (
            dict(async_rollouts=True, tools=["python"]),
            "the hf engine resumes them in rounds: use --async_batching waves",
        ),
        (dict(async_batching="waves"), "--async_batching waves would be ignored: it applies with --async_rollouts"),
    ],
)
def test_bad_async_settings_are_refused_with_the_flag_and_the_fix(micro_model, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        micro_config(micro_model, tmp_path / "run", **changes)


@pytest.mark.parametrize(
    "changes,message",
    [
        # vLLM's tool rollouts resume completions as new requests and take no weights between steps
        (dict(tools=["python"], async_batching="waves"), "use --engine hf, or --partial_rollouts false"),
        # a request keeps the adapter it was added with
        (dict(use_peft=True, lora_sync="adapter"), "use --lora_sync merged, or --partial_rollouts false"),
    ],
)
def test_partial_rollouts_vllm_cannot_serve_are_refused(micro_model, tmp_path, monkeypatch, changes, message):
    """Checked as if vLLM were installed: the refusals must not depend on it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=message):
        micro_config(
            micro_model, tmp_path / "run", async_rollouts=True, partial_rollouts=True, engine="vllm", **changes
        )


def test_lora_runs_asynchronously_and_the_engine_ends_with_the_trained_adapter(micro_model, tmp_path):
    """--use_peft: the rollout copy takes the adapter in flight (the frozen base never changes); after
    the last update the copy the engine samples from holds the trained adapter exactly."""
    pytest.importorskip("peft")
    trainer = Trainer(
        micro_config(
            micro_model,
            tmp_path / "run",
            steps=3,
            eval_every=0,
            save_every=0,
            use_peft=True,
            lr=1e-2,
            async_rollouts=True,
            max_staleness=1,
            **LEARNS,
        )
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    trained = dict(trainer.model.named_parameters())
    copied = dict(trainer.rollout_policy.model.named_parameters())
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # the adapter moved
    for name in initial:
        assert torch.equal(copied[name], trained[name]), name
