"""Atomic checkpoints: a finished checkpoint directory appears whole or not at all.

Layout: RUN_DIR/checkpoints/step_000020/ holds the model and tokenizer (`save_pretrained`) and
`trainer_state.pt` (optimizer, scheduler, data order, RNG states, step); RUN_DIR/checkpoints/latest
names the newest one. Each is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, keep: int) -> Path:
    """Write checkpoints/step_<step>/ atomically, point `latest` at it, delete older ones beyond `keep`."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step_{step:06d}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / "latest", final.name)
    finished = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in finished[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a crash during a save
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False)
