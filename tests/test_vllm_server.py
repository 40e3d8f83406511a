"""vLLM's own OpenAI-compatible server as the rollout engine (`VLLMServerEngine`, `--vllm_server`;
docs/vllm.md): mu and its top-K against fresh float32 HF forwards before and after a weight update,
continuous batching and tool calls over HTTP, the endpoint open to any OpenAI client, the abort of
given-up requests, no server left behind by a closed engine or a killed trainer, and a whole
asynchronous `gppo train`. Skipped where vLLM is not installed; `.ci/run` runs it in the vLLM venv."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from gppo.models.loading import load_model_and_tokenizer  # noqa: E402
from gppo.options import ConfigError  # noqa: E402
from gppo.rollout import GroupRequest, SamplingParams, make_engine  # noqa: E402
from gppo.rollout.vllm_server import server_topk  # noqa: E402
from gppo.rollout.vllm_setup import vllm_model_dir  # noqa: E402
from gppo.trainer import Trainer  # noqa: E402
from gppo.trainer.config import from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T, K, KV_GB = 0.7, 20, 0.25
FP32_TOL, TOPK_TOL = 1e-4, 2e-4  # as tests/test_vllm_engine.py (the same kernels, in another process)
QUESTIONS = ["What is 12 + 30? Answer with the number.", "Name a prime number below 10."]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    """SmolLM2 (float32, as vLLM loads it), its chat prompts, and a server engine over it."""
    os.environ.setdefault("GPPO_CACHE", str(tmp_path_factory.mktemp("gppo-cache")))
    directory = vllm_model_dir(smollm2_gguf)
    model, tokenizer = load_model_and_tokenizer(directory, dtype=torch.float32)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    engine = make_engine("vllm", model, tokenizer, model_path=directory, kv_cache_gb=KV_GB, max_logprobs=K, server=True)
    yield model, tokenizer, prompts, engine
    engine.close()


def hf_log_probs(model, g) -> torch.Tensor:
    """log softmax(logits / T) [completion length, V] of a fresh float32 HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([g.prompt_ids + g.completion_ids])).logits[0, len(g.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float() / T, dim=-1)


def max_gaps(model, gens) -> tuple[float, float]:
    """(max |log mu - log pi| of the sampled tokens, of mu's top-K entries) over every position."""
    sampled = topk = 0.0
    for g in gens:
        ref, ids = hf_log_probs(model, g), torch.tensor(g.completion_ids)
        sampled = max(sampled, (torch.tensor(g.logprobs) - ref[torch.arange(len(ids)), ids]).abs().max().item())
        topk = max(topk, (torch.tensor(g.topk_logprobs) - ref.gather(1, torch.tensor(g.topk_ids))).abs().max().item())
    return sampled, topk


def test_server_topk_reads_both_layouts_of_the_servers_entry():
    """The sampled token's entry comes first: within the top K it is one of them, else one more."""
    assert server_topk({"token_id:7": -3.0, "token_id:1": -0.1, "token_id:2": -0.5}, 2) == ([1, 2], [-0.1, -0.5])
    assert server_topk({"token_id:2": -0.5, "token_id:1": -0.1}, 2) == ([1, 2], [-0.1, -0.5])
    with pytest.raises(RuntimeError, match="1 top log-probs for a token, 3 requested"):
        server_topk({"token_id:2": -0.5}, 3)


def test_the_servers_mu_is_exact_before_and_after_new_weights(smollm2):
    """mu and its top-20 from the server equal a fresh float32 HF forward; after a perturbation is
    loaded (/collective_rpc), they equal the new weights' forward and no longer the old ones'."""
    model, tokenizer, prompts, engine = smollm2
    params = SamplingParams(temperature=T, max_new_tokens=24, n=2, top_k_logprobs=K, seed=3)
    gens = engine.generate(prompts, params)
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1] and all(g.completion_ids for g in gens)
    sampled, topk = max_gaps(model, gens)
    assert sampled <= FP32_TOL and topk <= TOPK_TOL, (sampled, topk)
    new = load_model_and_tokenizer(model.name_or_path, dtype=torch.float32)[0]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if "layers.3.mlp" in name or "embed_tokens" in name:  # the tied head moves too
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    engine.update_weights(new)
    after = engine.generate(prompts, params)
    assert max(max_gaps(new, after)) <= TOPK_TOL
    assert max_gaps(model, after)[0] > 1e-2  # the old weights would miss
    engine.update_weights(model)


def test_groups_stream_through_the_server_with_their_own_draws(smollm2):
    """Continuous batching over HTTP: groups given at the first, fourth and seventh look end with
    the version they were sampled by, and each draws what it draws alone with its row seeds."""
    model, tokenizer, prompts, engine = smollm2
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    looks, finished = [], {}

    def feed(room: int) -> list[GroupRequest]:
        looks.append(room)
        due = {1: 0, 4: 1, 7: 2}.get(len(looks))
        return [] if due is None else [GroupRequest(due, encoded[due % 2], (7 * due, 7 * due + 1))]

    params = SamplingParams(temperature=T, max_new_tokens=12, n=2, top_k_logprobs=K, policy_version=lambda: 5)
    engine.stream(feed, params, finished.__setitem__)
    assert sorted(finished) == [0, 1, 2]
    for key, gens in finished.items():
        alone = engine.generate(
            [encoded[key % 2]], SamplingParams(temperature=T, max_new_tokens=12, n=2, row_seeds=(7 * key, 7 * key + 1))
        )
        assert [a.completion_ids for a in alone] == [g.completion_ids for g in gens]
        assert all(g.versions == [5] * len(g.completion_ids) for g in gens)
    assert max(max_gaps(model, [g for gens in finished.values() for g in gens])) <= TOPK_TOL


def _post(engine, path: str, body: dict) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    return json.loads(response.read())


def _running_requests(engine) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def test_any_openai_client_can_chat_with_the_policy_being_trained(smollm2):
    """The endpoint an environment would call: /v1/chat/completions with the model's chat template."""
    _, _, _, engine = smollm2
    assert engine.base_url == f"http://127.0.0.1:{engine.port}/v1"
    reply = _post(
        engine,
        "/v1/chat/completions",
        {"model": engine.served_model, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 16},
    )
    assert reply["choices"][0]["message"]["content"].strip()


def test_a_stopped_stream_leaves_no_request_running_in_the_server(smollm2):
    """A stream whose feed raises (the trainer stopped) gives up its requests: their connections
    close and vLLM aborts them, so the server runs none a moment later."""
    _, tokenizer, prompts, engine = smollm2
    encoded = tokenizer(prompts[0])["input_ids"]
    looks = []

    def feed(room: int) -> list[GroupRequest]:
        looks.append(room)
        if len(looks) == 1:
            return [GroupRequest(k, encoded, (k, k + 100)) for k in range(4)]
        if len(looks) == 20:
            raise KeyboardInterrupt
        return []

    with pytest.raises(KeyboardInterrupt):
        engine.stream(feed, SamplingParams(temperature=T, max_new_tokens=2000, n=2), lambda key, gens: None)
    deadline = time.monotonic() + 30
    while _running_requests(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_requests(engine) == 0


def test_tool_calls_resume_through_the_server_with_exact_mu():
    """The multiplication warm start with the python tool through the server (`requests`, stop
    strings applied by the server's own tokenizer): completions stop at a closed ```python block,
    the sandbox's output joins as tool tokens, sampling resumes; mu at the model's tokens equals a
    float32 HF forward, tool tokens carry 0. Closing the engine stops its server's processes."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.rollout.tools import PythonTool, ToolEngine
    from gppo.tasks import get_task, heldout_problems

    base = embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
    server = make_engine(
        "vllm", model, tokenizer, model_path=base, kv_cache_gb=KV_GB, code_block_stops=True, server=True
    )
    engine = ToolEngine(server, tokenizer, PythonTool())
    problems = heldout_problems(get_task("multiplication"), 16)
    gens = engine.generate([p.prompt for p in problems], SamplingParams(temperature=T, max_new_tokens=64, n=4, seed=0))
    called = [g for g in gens if g.tool_calls]
    assert 0.2 < len(called) / len(gens) < 0.9, len(called)
    for g in gens:
        ref, ids = hf_log_probs(model, g), torch.tensor(g.completion_ids)
        mine = torch.tensor(g.tool_mask, dtype=torch.bool)
        gap = (torch.tensor(g.logprobs) - ref[torch.arange(len(ids)), ids]).abs()
        assert gap[mine].max() <= FP32_TOL and (torch.tensor(g.logprobs)[~mine] == 0).all()
    group = os.getpgid(server.process.pid)
    server.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


def test_a_killed_trainer_leaves_no_server_behind(tmp_path):
    """The server dies with the process that started it (SIGKILL gives that process no chance to
    stop it): its whole process group is gone within a minute."""
    script = (
        "import sys, time\n"
        "from gppo.models.assets import embedded_checkpoint\n"
        "from gppo.models.loading import load_model_and_tokenizer\n"
        "from gppo.rollout import make_engine\n"
        "if __name__ == '__main__':\n"
        "    base = embedded_checkpoint('multiplication')\n"
        "    model, tokenizer = load_model_and_tokenizer(base)\n"
        "    engine = make_engine('vllm', model, tokenizer, model_path=base, kv_cache_gb=0.25, server=True)\n"
        "    print(engine.process.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=dict(os.environ)
    )
    server = int(child.stdout.readline())
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(server, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(server, signal.SIGKILL)
    pytest.fail("the server outlived the process that started it")


def _run(tmp_path, name, **changes):
    values = dict(
        task="addition",
        engine="vllm",
        vllm_server=True,
        vllm_kv_cache_gb=KV_GB,
        output_dir=str(tmp_path / name),
        steps=3,
        prompts_per_step=8,
        group_size=4,
        mini_batch_size=16,
        micro_batch_size=16,
        eval_every=0,
        eval_size=8,
        eval_samples=1,
        lr=1e-3,
        progress=False,
        threads=1,
    )
    values.update(changes)
    return Trainer(from_dict(values))


def test_gppo_train_asynchronously_through_the_server(tmp_path):
    """`gppo train --engine vllm --vllm_server true --async_rollouts true --max_staleness 1`, embedded
    model: three updates, no token more than one version behind, and at lag 0 mu (the server's)
    matches the trainer's pi_old; the server stops with the run."""
    trainer = _run(tmp_path, "async", async_rollouts=True, max_staleness=1)
    process = trainer.engine.process
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "loss/masked_frac" in r]
    assert len(updates) == 3
    for r in updates:
        assert r["staleness/token_max"] <= 1
        if r["staleness/token_min"] == 0:
            assert r["staleness/mismatch_kl_k3/lag0"] < 1e-6, r
    assert process.poll() is not None


def test_gppo_train_streams_tool_rollouts_through_the_server(tmp_path):
    """`--tools python --async_rollouts true` (continuous batching, the default) through the server on
    the multiplication warm start: the rollouts call the tool, tokens stay within the staleness
    bound, and at lag 0 mu at the model's tokens matches the trainer's pi_old."""
    trainer = _run(
        tmp_path,
        "tools",
        task="multiplication",
        tools=["python"],
        max_new_tokens=64,
        async_rollouts=True,
        max_staleness=1,
    )
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "tools" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "loss/masked_frac" in r]
    assert len(updates) == 3 and all(r["rollout/tool_call_frac"] > 0.2 for r in updates), updates
    for r in updates:
        assert r["staleness/token_max"] <= 1
        if r["staleness/token_min"] == 0:
            assert r["staleness/mismatch_kl_k3/lag0"] < 1e-6, r


@pytest.mark.parametrize(
    "changes,refusal",
    [
        (dict(vllm_own_process=False), "--vllm_own_process false with --vllm_server true"),
        (dict(async_rollouts=True, partial_rollouts=True), "--partial_rollouts with --vllm_server true"),
        (dict(rollout_top_p=0.9), "--rollout_top_p 0.9 with --vllm_server true"),
        (dict(use_peft=True, lora_sync="adapter"), "--lora_sync adapter with --vllm_server true"),
    ],
)
def test_what_the_server_cannot_do_is_refused_by_name(tmp_path, changes, refusal):
    with pytest.raises(ConfigError, match=refusal):
        _run(tmp_path, "refused", **changes)
