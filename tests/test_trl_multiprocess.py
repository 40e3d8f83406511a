"""GPPOTrainer across processes: `accelerate launch --num_processes 2` on CPU (gloo) runs
tests/trl_multiprocess_job.py, which trains TRL's GRPOTrainer (loss_type "dapo"), GPPOTrainer
(gppo_preset "ppo", its equivalent, docs/trl.md) and GPPOTrainer with a top-K preset for 2
optimizer steps of 2 micro-batches each, both from one generation batch. The completions end at
different lengths, so the two processes and the micro-batches hold different token counts:
GPPOTrainer ends at TRL's weights only if it normalises across processes and accumulation steps
as TRL does. The dapo / ppo pair runs again with a LoRA adapter and with TRL's `tools` (tool
results inside the completions, which neither loss counts)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from gppo.models.embedded import build_model, build_tokenizer  # noqa: E402
from tests import trl_tools  # noqa: E402

JOB = Path(__file__).with_name("trl_multiprocess_job.py")
PROMPTS = ["12+3=", "4*5=", "7-2=", "9+9=", "1+1=", "30/3=", "8-8=", "2*7="]


def model_that_stops(path: Path) -> list[torch.Tensor]:
    """The tiny Qwen2 with its EOS embedding (tied to the output layer) set along the mean final
    hidden state of the prompts, so that sampled completions end at various lengths (a fresh
    model almost never samples EOS). Saved to `path`; returns its parameters."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2)
    prompts = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**prompts, output_hidden_states=True).hidden_states[-1][prompts.attention_mask.bool()]
        mean = hidden.mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = 2.0 * mean / (mean @ mean)
    model.save_pretrained(path)
    return [p.detach().clone() for p in model.parameters()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl_multiprocess")
    initial = {"": model_that_stops(path / "model"), "-tools": trl_tools.save_chat_model(path / "chat")}
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(JOB),
        str(path / "model"),
        str(path / "chat"),
        str(path / "result.pt"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return initial, torch.load(path / "result.pt", weights_only=False)


def losses(run):
    return [h["loss"] for h in run["logs"] if "loss" in h]


def test_runs_on_two_gloo_processes_with_unequal_token_counts(runs):
    _, results = runs
    for run in results.values():
        assert (run["num_processes"], run["backend"]) == (2, "gloo")
        counts = [count for rank in run["tokens"] for count in rank]
        assert len(counts) == 8 and len(set(counts)) > 1, counts  # 2 ranks x 4 micro-batches
        # the gradients were synchronised: both ranks end at the same weights
        assert run["digests"][0] == pytest.approx(run["digests"][1], rel=1e-6), run["digests"]


@pytest.mark.parametrize("runs_with", ["", "-tools"])
def test_gppo_ppo_ends_at_trl_dapo_weights(runs, runs_with):
    """Same seed, same generations: GPPOTrainer(ppo) logs TRL's (dapo) losses and ends at its weights;
    with tools, tool results lie inside the completions of both processes."""
    initial, results = runs
    trl, ours = results["trl-dapo" + runs_with], results["gppo-ppo" + runs_with]
    assert ours["tokens"] == trl["tokens"] and ours["tool_tokens"] == trl["tool_tokens"]
    assert all(sum(rank) > 0 for rank in ours["tool_tokens"]) == (runs_with == "-tools")
    assert len(losses(ours)) == 2 and losses(ours)[1] != 0
    assert losses(ours) == pytest.approx(losses(trl), abs=1e-6)
    assert [h for h in ours["logs"] if "loss" in h][1]["gppo/ratio/max"] > 1
    assert max((p - q).abs().max() for p, q in zip(trl["params"], initial[runs_with], strict=True)) > 1e-3
    for p, trl_p in zip(ours["params"], trl["params"], strict=True):
        assert torch.allclose(p, trl_p, rtol=0, atol=1e-6), (p - trl_p).abs().max()


def test_lora_adapters_match_trl_and_topk_trains_across_processes(runs):
    """With a LoRA adapter (TRL's peft_config) on two processes: GPPOTrainer(ppo)'s adapter equals
    GRPOTrainer(loss_type="dapo")'s, and dppo-topk-kl's top-K passes through the peft-wrapped,
    DDP-wrapped model move the adapter; the base weights stay as they were in every run."""
    initial, results = runs
    if "gppo-ppo-lora" not in results:
        pytest.skip("peft is not installed (pip install peft)")
    trl, ours, topk = results["trl-dapo-lora"], results["gppo-ppo-lora"], results["gppo-dppo-topk-kl-lora"]
    assert ours["tokens"] == trl["tokens"] and losses(ours) == pytest.approx(losses(trl), abs=1e-6)
    assert ours["adapter"] and ours["adapter"].keys() == trl["adapter"].keys()
    assert any(p.abs().max() > 0 for n, p in ours["adapter"].items() if "lora_B" in n)  # B starts at 0
    for name, p in ours["adapter"].items():
        assert torch.allclose(p, trl["adapter"][name], rtol=0, atol=1e-6), name
    assert any(p.abs().max() > 0 for n, p in topk["adapter"].items() if "lora_B" in n)
    assert len([h for h in topk["logs"] if "loss" in h]) == 2
    for run in (trl, ours, topk):
        assert run["digests"][0] == pytest.approx(run["digests"][1], rel=1e-6)  # both ranks agree
        for p, q in zip(run["params"], initial[""], strict=True):
            assert torch.equal(p, q)


def test_topk_preset_trains_across_processes(runs):
    initial, results = runs
    run = results["gppo-dppo-topk-tv"]
    logs = [h for h in run["logs"] if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        values = {name: value for name, value in log.items() if name.startswith("gppo/") or name in ("loss", "entropy")}
        assert "gppo/masked_frac" in values and "entropy" in values
        assert all(torch.isfinite(torch.tensor(float(v))) for v in values.values()), values
    assert logs[1]["gppo/ratio/max"] > 1
    assert all(torch.isfinite(p).all() for p in run["params"])
    assert max((p - q).abs().max() for p, q in zip(run["params"], initial[""], strict=True)) > 1e-3
