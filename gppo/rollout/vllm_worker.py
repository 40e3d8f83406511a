"""Weights into vLLM's own processes, both ends. The trainer's process writes them to one
safetensors file in shared memory (`weights_in_shared_memory`: /dev/shm where it exists); gppo's
extension of vLLM's worker (`WeightLoading`, vLLM's `worker_extension_cls`), run in the worker's
process by `collective_rpc` (`VLLMEngine` with `own_process=True`; `VLLMServerEngine` through the
server's /collective_rpc), reloads them in place and re-ties (on CPU, re-packs) a tied LM head with
`retie_head` / `retie_and_repack_head`, which `VLLMEngine.update_weights` applies in-process too
(gppo.rollout.vllm's docstring).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def weights_in_shared_memory(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """The path of one safetensors file holding `weights` (on CPU), deleted when the block ends."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().to("cpu").contiguous() for name, p in weights}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="gppo-weights-", suffix=".safetensors", dir=shm)
    os.close(handle)
    try:
        save_file(tensors, path)
        yield path
    finally:
        os.unlink(path)


class WeightLoading:
    def gppo_load_weights(self, path: str, tied_head: bool, on_cpu: bool) -> None:
        from safetensors.torch import load_file

        self.reload_weights(weights_iterator=list(load_file(path).items()))
        if tied_head:
            self.apply_model(retie_and_repack_head if on_cpu else retie_head)


def retie_head(model: torch.nn.Module) -> None:
    """Point a tied LM head at the reloaded embeddings (the reload may give them a new Parameter)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None or not hasattr(model, "lm_head"):
        raise RuntimeError(
            f"{type(model).__name__} ties its LM head to its embeddings, but gppo only knows how to "
            "re-tie models with model.embed_tokens and lm_head (Llama, Qwen2, Mistral, ...)"
        )
    model.lm_head.weight = embed.weight


def retie_and_repack_head(model: torch.nn.Module) -> None:
    """CPU: re-tie, then rebuild the packed copy of the head's weight that the CPU GEMM multiplies
    with (`dispatch_cpu_unquantized_gemm`, keeping the weight: the embeddings still need it)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    retie_head(model)
    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
