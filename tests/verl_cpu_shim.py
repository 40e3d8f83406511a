"""What verl 0.9.1's FSDP training engine needs to run on a CPU, for tests/test_verl_engine.py.

verl picks its device through a platform singleton (verl.plugin.platform) that knows CUDA, NPU and
ROCm only, and registers FSDPEngineWithLMHead for the devices "cuda" and "npu". `install()`:
- sets a CPU platform (device "cpu", gloo, memory statistics reported as 0, since torch.cpu has none)
  before any verl module asks for the device;
- makes EngineRegistry hand out the CUDA engine class (VERL_ENGINE_DEVICE=cuda): its code runs on
  CPU once every `.to(get_device_id())` goes to "cpu";
- sets the environment verl's Worker reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and starts
  a gloo process group;
- tells verl's model patching that TRL is absent. Not a CPU matter: with TRL >= 1.0 installed (gppo's
  [trl] extra), verl 0.9.1's apply_monkey_patch imports trl's AutoModelForCausalLMWithValueHead,
  which TRL 1.x no longer has, and every FSDP engine fails to build (docs/verl.md says so).

Call it first in a fresh process (the test runs it in a subprocess): it changes os.environ and
process-wide singletons. tests/verl_cpu_main_ppo.py builds the whole main_ppo's CPU set-up on its
platform. Nothing in gppo imports this module.
"""

from __future__ import annotations

import datetime
import os
import socket
import types
from contextlib import contextmanager

import torch


def _memory_zero(*args, **kwargs):
    return 0


class _CPUDeviceModule(types.ModuleType):
    """torch.cpu plus the allocator statistics verl logs (torch.cpu has none): all 0."""

    def __init__(self):
        super().__init__("verl_cpu_device")
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "reset_peak_memory_stats",
            "empty_cache",
            "ipc_collect",
        ):
            setattr(self, name, _memory_zero)

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*args, **kwargs):
        return "CPU"  # verl's FLOPs table has no entry for it: MFU is reported as 0

    @staticmethod
    def mem_get_info(*args, **kwargs):
        return 0, 0

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def is_available():
        return True


def cpu_platform_class(ray_resource: str = "CPU"):
    """verl's device platform for a CPU; `ray_resource` names the Ray resource verl's placement asks
    for per worker (main_ppo places workers on "GPU" bundles: tests/verl_cpu_main_ppo.py declares one)."""
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPUDeviceModule()

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # verl moves batches with .to(get_device_id())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return ray_resource

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return PlatformCPU


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """CPU platform, CUDA engine class, Worker environment, gloo process group (module docstring)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or os.environ.get("MASTER_PORT") or free_port()),
        VERL_ENGINE_DEVICE="cuda",
        TOKENIZERS_PARALLELISM="false",
    )
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    from verl.plugin.platform import set_platform

    set_platform(cpu_platform_class()())
    import verl.models.transformers.monkey_patch as monkey_patch

    monkey_patch.is_trl_available = lambda: False
    if not torch.distributed.is_initialized():  # a peer that died surfaces in 2 minutes, not gloo's 30
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
