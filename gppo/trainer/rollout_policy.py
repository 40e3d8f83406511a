"""Training-inference mismatch on purpose: the policy the engine samples from, the rollouts
sampled ahead, and the measured gap between the behaviour policy mu and the trainer's pi_old.

Real LLM RL samples with other numerics than it trains with (bf16/fp16 kernels, INT8/FP8
weights) and trains on rollouts a few updates old (one-step-off-policy and asynchronous
systems). Three `gppo train` knobs reproduce that (docs/design.md section 1, anchors):

- `rollout_dtype`: the engine samples from a copy of the weights in that dtype; the copy is
  allocated once and refreshed by `copy_` after every update. Only the base's weights change
  dtype: a LoRA adapter (float32, as peft keeps it on a bfloat16 base) and the float32 buffers
  (the rotary `inv_freq`) stay as they are, as in a model loaded in that dtype.
- `rollout_quantization='int8'`: the copy's `torch.nn.Linear` weights are fake-quantized
  per output channel (`fake_quantize_int8`); the token embeddings and the output head keep the
  rollout dtype, as weight-only INT8 recipes usually leave them (tied to the embeddings in
  small models, they would also change the input side).
- `off_policy_steps=k`: the batch trained at step t was sampled with the weights of step
  t - k; the first k batches are sampled with the initial weights. Rollouts sampled ahead are
  part of the checkpoint, so a resumed run is exact. With `rollout_overlap` the rollout of step
  t + k is sampled in a background thread, from a copy of the step-t weights, while step t's
  update trains: the same batches, only the wall time changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields

import torch

from gppo.models.adapters import is_adapter_parameter
from gppo.trainer.batch import Rollout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RATIO_QUANTILES = (0.01, 0.5, 0.99)


def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8 round trip of a [out, in] weight, in float32:
    s_i = max_j |w_ij| / 127, w_ij -> round(w_ij / s_i) * s_i (round half to even; a zero row
    stays zero). The result has at most 255 distinct values per row."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale) * scale


class RolloutPolicy:
    """The model the rollout engine samples from: the training model itself when no knob asks
    otherwise, else a copy in `dtype` (fake-quantized when `quantization='int8'`; `separate`
    asks for a copy even in the training dtype, for sampling while the model trains)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, quantization: str = "none", separate: bool = False):
        train_dtype = next(model.parameters()).dtype
        self.is_copy = separate or dtype != train_dtype or quantization != "none"
        self.model = model
        self._quantized: set[str] = set()
        if not self.is_copy:
            return
        # requires_grad stays as in `model` (never used: the engine samples under inference_mode):
        # with it off, some CPU kernels round the last bit differently, and an overlap copy in the
        # training dtype must sample exactly as the training model would.
        self.model = copy.deepcopy(model).eval()
        with torch.no_grad():  # the base's weights alone: a LoRA adapter and the buffers keep their dtype
            for name, p in self.model.named_parameters():
                if not is_adapter_parameter(name):
                    p.data = p.data.to(dtype)
        if quantization == "int8":
            head = model.get_output_embeddings()
            self._quantized = {
                f"{name}.weight"
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and module is not head
            }
        self.refresh(model, frozen_too=True)

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module, frozen_too: bool = False) -> None:
        """Copy `model`'s trainable parameters into the rollout copy's own tensors (no allocation of
        the copy; int8 weights go through `fake_quantize_int8`); frozen ones (a LoRA adapter's base)
        never change, so after the first copy only the adapter moves. A no-op without a copy."""
        if not self.is_copy:
            return
        for (name, source), target in zip(model.named_parameters(), self.model.parameters()):
            if frozen_too or source.requires_grad:
                target.copy_(fake_quantize_int8(source) if name in self._quantized else source)


class OffPolicyQueue:
    """Rollouts sampled ahead, for off_policy_steps = k >= 1: the batch of step t is sampled at step
    max(0, t - k), with the weights of that step. At step t the trainer samples, with the current
    weights, every batch up to step t + k not sampled yet (`due`, `put`), then `take`s step t's.
    With `background`, step t + k's is sampled in a thread while step t trains (`submit`); `wait()`
    (before the weights it samples from change) adds it to the queue."""

    def __init__(self, steps_ahead: int, background: bool = False):
        self.steps_ahead = steps_ahead
        self.pending: list[tuple[int, int, Rollout | None, dict]] = []  # (for step, sampled at, ...)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gppo-rollout") if background else None
        self._in_flight: tuple[int, int, Future] | None = None

    def due(self, step: int) -> list[tuple[int, bool]]:
        """(target step, in the background?) of each batch to sample at `step`, in order: every
        step up to step + k not sampled yet; the last one in the background when the queue has a
        thread and the batch is for a later step."""
        self.wait()
        first = self.pending[-1][0] + 1 if self.pending else step
        last = step + self.steps_ahead
        return [(target, self._executor is not None and target == last > step) for target in range(first, last + 1)]

    def put(self, target: int, sampled_at: int, rollout: Rollout | None, stats: dict) -> None:
        self.pending.append((target, sampled_at, rollout, stats))

    def submit(self, target: int, sampled_at: int, sample: Callable[[int], tuple[Rollout | None, dict]]) -> None:
        """Sample step `target`'s batch in the background thread (sample(target) -> rollout, stats)."""
        self._in_flight = (target, sampled_at, self._executor.submit(sample, target))

    def take(self, step: int) -> tuple[Rollout | None, dict]:
        """Step `step`'s batch and its stats, with the policy lag (steps between sampling and use)."""
        target, sampled_at, rollout, stats = self.pending.pop(0)
        if target != step:
            raise RuntimeError(
                f"the rollout queue holds step {target}'s batch at step {step}: "
                "the checkpoint's pending rollouts do not belong to this run"
            )
        return rollout, {**stats, "mismatch/policy_lag": step - sampled_at}

    def wait(self) -> None:
        """Queue the rollout sampling in the background, if any (its errors are raised here)."""
        if self._in_flight is not None:
            target, sampled_at, future = self._in_flight
            self._in_flight = None
            self.pending.append((target, sampled_at, *future.result()))

    def state_dict(self) -> list:
        self.wait()
        return [
            (target, sampled_at, None if r is None else {f.name: getattr(r, f.name) for f in fields(r)}, stats)
            for target, sampled_at, r, stats in self.pending
        ]

    def load_state_dict(self, state: list) -> None:
        self.pending = [
            (target, sampled_at, None if r is None else Rollout(**r), stats) for target, sampled_at, r, stats in state
        ]


def mismatch_metrics(rollout: Rollout) -> dict:
    """The gap between pi_old (the trainer's recomputation) and mu (the engine) on the sampled
    tokens a ~ mu, with d = log pi_old(a) - log mu(a), in float64 from the float32 inputs:
    |pi_old(a) - mu(a)| (mean, max); KL(mu || pi_old) by the sample estimator mean(-d) (k1) and
    by mean(e^d - 1 - d) (k3, Schulman 2020: unbiased, >= 0 per token); quantiles of the ratio
    pi_old(a) / mu(a). Empty when pi_old was not recomputed."""
    if rollout.logp_old is None:
        return {}
    valid = rollout.response_mask.bool()
    old = rollout.logp_old[valid].cpu().double()
    mu = rollout.logp_behavior[valid].cpu().double()
    d = old - mu
    gap = (old.exp() - mu.exp()).abs()
    ratio = d.exp()
    quantiles = torch.quantile(ratio, torch.tensor(RATIO_QUANTILES, dtype=torch.float64))
    values = {
        "mismatch/prob_diff/mean": gap.mean(),
        "mismatch/prob_diff/max": gap.max(),
        "mismatch/kl_sample": (-d).mean(),
        "mismatch/kl_k3": (torch.expm1(d) - d).mean(),
        **{f"mismatch/ratio/q{q:g}": value for q, value in zip(RATIO_QUANTILES, quantiles)},
    }
    return {key: value.item() for key, value in values.items()}
