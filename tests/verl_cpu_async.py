"""What verl 0.9.1's fully-async trainer needs on a CPU beyond main_ppo's (tests/verl_cpu_main_ppo.py,
imported first), for the verl-async row of `bash benchmarks/gpu_check.sh --cpu` (run by hand; CI does
not run it). Imported in every process verl starts through
VERL_USE_EXTERNAL_MODULES=tests.verl_cpu_async, and by verl's checkpoint-engine loader through
actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tests.verl_cpu_async.

The fully-async trainer moves weights from the trainer's actor to the separate rollout replicas with a
checkpoint engine (`rollout.checkpoint_engine.backend`, "nccl" in verl's fully-async config); every
engine verl 0.9.1 ships sends over an accelerator (NCCL, HCCL, NIXL, Mooncake, Kimi) or only works
colocated ("naive"). `FileCheckpointEngine` (backend "cpu_file") sends them through one file per sync
on this machine: the actor's rank 0 saves every full tensor, each rollout worker loads them and hands
them to verl's own vLLM server adapter, whose CPU weight reload tests/verl_cpu_main_ppo.py sets up.

Not a CPU matter: at each sync verl 0.9.1's server aborts the in-flight requests with
`AsyncLLM.pause_generation(wait_for_inflight_requests=False, ...)` (vllm_async_server.py,
abort_all_requests), the signature of the vLLM verl[vllm]==0.9.1 pins (0.24); vLLM 0.32 (the CPU build
here) takes `mode="abort" | "wait" | "keep"` instead and raises TypeError. `pause_generation` is
given the old keyword, mapped to the new one.
Nothing in gppo imports this module.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import tempfile
import uuid

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from vllm.v1.engine.async_llm import AsyncLLM

import tests.verl_cpu_main_ppo  # noqa: F401  (main_ppo's CPU set-up, in this process)

_pause_generation = AsyncLLM.pause_generation


async def _pause_with_verl_keyword(self, *, wait_for_inflight_requests=None, mode="abort", clear_cache=True):
    """vLLM 0.32's pause_generation, also taking verl 0.9.1's `wait_for_inflight_requests` (vLLM 0.24's)."""
    if wait_for_inflight_requests is not None:
        mode = "wait" if wait_for_inflight_requests else "abort"
    return await _pause_generation(self, mode=mode, clear_cache=clear_cache)


if "wait_for_inflight_requests" not in inspect.signature(_pause_generation).parameters:
    AsyncLLM.pause_generation = _pause_with_verl_keyword


@CheckpointEngineRegistry.register("cpu_file")
class FileCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine interface over a file in the temporary folder: the actor's rank 0
    writes (name, tensor) pairs atomically, the rollout workers wait for the file and read it;
    `finalize` on the actor's rank 0 removes it."""

    def __init__(self, bucket_size: int, is_master: bool = False, poll_s: float = 0.05) -> None:
        self.is_master, self.poll_s, self.path = is_master, poll_s, None

    def prepare(self) -> dict:
        if self.is_master:  # the actor's rank 0 names the sync's file
            return {"path": os.path.join(tempfile.gettempdir(), f"gppo-weights-{uuid.uuid4().hex}.pt")}
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        path = next(entry["path"] for entry in metadata if entry.get("path"))
        return {"path": [path] * actor_wg_world_size}, {"path": [path] * rollout_world_size}

    def init_process_group(self, path: str):
        self.path = path

    def finalize(self):
        if self.is_master and self.path and os.path.exists(self.path):
            os.remove(self.path)
        self.path = None

    async def send_weights(self, weights, global_steps: int | None = None):
        tensors = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]  # all ranks gather
        if self.is_master:
            partial = f"{self.path}.partial"
            torch.save(tensors, partial)
            os.replace(partial, self.path)

    async def receive_weights(self, global_steps: int | None = None):
        while not os.path.exists(self.path):
            await asyncio.sleep(self.poll_s)
        for name, tensor in torch.load(self.path, weights_only=True):
            yield name, tensor
