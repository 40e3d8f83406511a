"""`WeightLoading`: gppo's extension of vLLM's worker (`worker_extension_cls`), for a `VLLMEngine`
that runs in a process of its own (`own_process=True`). The trainer's process writes the weights
to one safetensors file in shared memory (/dev/shm where it exists); this method, run in the
worker's process by `collective_rpc`, reloads them in place and re-ties (on CPU, re-packs) a tied
LM head, as `VLLMEngine.update_weights` does in-process (gppo.rollout.vllm's docstring).
"""

from __future__ import annotations


class WeightLoading:
    def gppo_load_weights(self, path: str, tied_head: bool, on_cpu: bool) -> None:
        from safetensors.torch import load_file

        from gppo.rollout.vllm import _retie_and_repack_head, _retie_head

        self.reload_weights(weights_iterator=list(load_file(path).items()))
        if tied_head:
            self.apply_model(_retie_and_repack_head if on_cpu else _retie_head)
