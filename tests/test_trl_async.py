"""GPPOAsyncTrainer against TRL's own AsyncGRPOTrainer, on CPU with a tiny local Qwen2 model.

No vLLM server and no NCCL: both trainers are built with a scripted rollout worker and a no-op weight
transfer (TRL's injection points, RolloutWorkerProtocol / WeightTransferProtocol), and their loss step
(compute_loss) runs on one micro-batch packed by TRL's own TreeRow and DataCollatorForRollout. TRL's
tree attention calls a FlashAttention-3 kernel (CUDA only); the test registers, under the same name,
an SDPA implementation of the same tree masking, used by both trainers alike, and stubs TRL's CUDA
peak-FLOPs probe (its MFU metric).
"""

import queue

import pytest
import torch

pytest.importorskip("trl.experimental.async_grpo")

from datasets import Dataset  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from trl.experimental.async_grpo import (  # noqa: E402
    AsyncGRPOConfig,
    AsyncGRPOTrainer,
    async_grpo_trainer,  # noqa: E402
)
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow  # noqa: E402

import gppo  # noqa: E402
from gppo.integrations.trl import GPPOAsyncConfig, GPPOAsyncTrainer  # noqa: E402
from gppo.models.embedded import build_model, build_tokenizer  # noqa: E402


class ScriptedRolloutWorker:
    """RolloutWorkerProtocol without a vLLM server: nothing is generated, the test supplies the batch."""

    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        pass


class NoWeightTransfer:
    """WeightTransferProtocol without NCCL."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        pass

    def resume(self):
        pass

    def destroy(self):
        pass


def sdpa_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index=None, tree_cu_seqlens_q=None,
                        tree_cu_seqlens_k=None, scaling=None, **kwargs):  # fmt: skip
    """Each segment's queries attend causally to the K/V of its root-to-segment path (TRL's tree
    attention semantics), by torch's SDPA one segment at a time; without a tree, one causal sequence."""
    if tree_kv_index is None:
        n = query.size(2)
        tree_kv_index = torch.arange(n)
        tree_cu_seqlens_q = tree_cu_seqlens_k = torch.tensor([0, n])
    query, key, value = (x.transpose(1, 2)[0] for x in (query, key, value))  # [N, H, D]
    key = key.repeat_interleave(query.size(1) // key.size(1), dim=1)
    value = value.repeat_interleave(query.size(1) // value.size(1), dim=1)
    out = torch.empty_like(query)
    for s in range(tree_cu_seqlens_q.numel() - 1):
        q0, q1 = tree_cu_seqlens_q[s].item(), tree_cu_seqlens_q[s + 1].item()
        path = tree_kv_index[tree_cu_seqlens_k[s] : tree_cu_seqlens_k[s + 1]]
        n_q, n_k = q1 - q0, path.numel()
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1), key[path].transpose(0, 1), value[path].transpose(0, 1),
            attn_mask=allowed, scale=scaling,
        ).transpose(0, 1)  # fmt: skip
    return out.unsqueeze(0), None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).save_pretrained(path / "model")
    return str(path / "model"), tokenizer, path


def make_trainer(tiny, monkeypatch, trainer_cls, config_cls, **fields):
    model, tokenizer, path = tiny
    # TRL reads the CUDA device's peak FLOPs for its MFU metric, which a CPU-only torch cannot answer.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: 1.0)
    args = config_cls(
        output_dir=str(path / "out"), use_cpu=True, report_to="none", seed=0, dtype="float32",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, token_budget=256,
        save_strategy="no", **fields,
    )  # fmt: skip
    trainer = trainer_cls(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": ["12+3=", "4*5="]}),
        rollout_worker=ScriptedRolloutWorker(),
        weight_transfer=NoWeightTransfer(),
    )
    # After construction: TRL's __init__ registers its FlashAttention-3 tree attention under this name.
    monkeypatch.setitem(AttentionInterface._global_mapping, TREE_ATTENTION, sdpa_tree_attention)
    return trainer


def rollout_batch(model, tokenizer, noise: float):
    """One micro-batch as TRL's collator packs it: three completions of one prompt (a shared prefix in
    the tree) and one of another, with the worker's log-probs mu = log pi + noise (ratios reach the clip)."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for prompt, length, advantage in (("12+3=", 6, 1.0), ("12+3=", 4, -0.5), ("12+3=", 5, 0.8), ("4*5=", 3, -1.2)):
        prompt_ids = torch.tensor(tokenizer(prompt).input_ids)
        completion = torch.randint(3, len(tokenizer), (length,), generator=gen)
        input_ids = torch.cat([prompt_ids, completion])
        with torch.no_grad():
            logp = model(input_ids[None]).logits[0, :-1].float().log_softmax(-1).gather(-1, input_ids[1:, None])[:, 0]
        old = torch.cat([torch.zeros(1), logp + noise * torch.randn(logp.shape, generator=gen)])
        mask = torch.cat([torch.zeros(len(prompt_ids)), torch.ones(length)]).long()
        samples.append(dict(input_ids=input_ids, completion_mask=mask, old_log_probs=old * mask,
                            advantage=advantage, group_id=0 if prompt == "12+3=" else 1, metrics={}))  # fmt: skip
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return DataCollatorForRollout(tokenizer.pad_token_id, 1).torch_call([[row]])


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop during training
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def test_ppo_equals_async_grpo_loss_and_gradient(tiny, monkeypatch):
    trl = make_trainer(tiny, monkeypatch, AsyncGRPOTrainer, AsyncGRPOConfig)
    ours = make_trainer(tiny, monkeypatch, GPPOAsyncTrainer, GPPOAsyncConfig, gppo_preset="ppo")
    inputs = rollout_batch(trl.model, tiny[1], noise=0.5)
    assert inputs["segment_id"].max() == 3 and inputs["input_ids"].size(1) < sum(  # the prompt is shared
        n for n in (5 + 6, 5 + 4, 5 + 5, 4 + 3)
    )
    trl_loss, trl_grads = loss_and_grads(trl, inputs)
    loss, grads = loss_and_grads(ours, inputs)
    assert 0 < ours._metrics["train"]["gppo/masked_frac"][-1] < 1  # both branches of the clip
    assert max(g.abs().max() for g in trl_grads) > 0
    assert torch.allclose(loss, trl_loss, rtol=0, atol=1e-6), (loss, trl_loss)
    for g, trl_g in zip(grads, trl_grads, strict=True):
        assert torch.allclose(g, trl_g, rtol=0, atol=1e-6), (g - trl_g).abs().max()
    assert ours._metrics["train"]["entropy"][-1] == pytest.approx(trl._metrics["train"]["entropy"][-1], abs=1e-5)


@pytest.mark.parametrize("preset", ["dppo-binary-tv", "dppo-binary-kl", "gspo", "sapo"])
def test_mu_anchored_presets_give_finite_loss_and_gradient(tiny, monkeypatch, preset):
    trainer = make_trainer(tiny, monkeypatch, GPPOAsyncTrainer, GPPOAsyncConfig, gppo_preset=preset)
    loss, grads = loss_and_grads(trainer, rollout_batch(trainer.model, tiny[1], noise=0.5))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads) and max(g.abs().max() for g in grads) > 0
    assert any(name.startswith("gppo/") for name in trainer._metrics["train"])


def test_config_refuses_what_it_cannot_run(tiny):
    out = str(tiny[2] / "out")
    with pytest.raises(gppo.GPPOConfigError, match="epsilon"):
        GPPOAsyncConfig(output_dir=out, use_cpu=True, epsilon=0.3)
    with pytest.raises(gppo.GPPOConfigError, match="binary"):
        GPPOAsyncConfig(output_dir=out, use_cpu=True, gppo_preset="dppo-topk-tv")
