"""Run directories that cannot be lost or mixed.

Layout of RUN_DIR: `config.yaml`, `metrics.jsonl`, `checkpoints/step_000020/` (model and tokenizer
from `save_pretrained`, `trainer_state.pt` with optimizer, scheduler, data order, RNG states and
step, `manifest.json` with every file's size), `checkpoints/latest` (the name of the newest
checkpoint), `final/`, and `.lock`.

- One process per run directory: `RunLock` holds an exclusive `flock` on RUN_DIR/.lock. The kernel
  drops the lock of a process that dies, so a killed run never blocks the next one.
- A checkpoint or `final/` appears whole or not at all: it is written under a `.tmp-` name, every
  file and directory in it is fsynced, it is renamed into place and its parent fsynced; only then
  does `latest` move (itself written to a temporary file, fsynced and renamed).
- Resuming takes the checkpoint `latest` names or, when that one fails its manifest or does not
  load, the previous one, with a warning.
- A full disk is a `NoSpaceError` naming the path; the temporary files are removed and the last
  good checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from gppo.models.adapters import save_model

TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
MANIFEST = "manifest.json"
# Everything the trainer writes in a run directory; a restart without a checkpoint moves these aside.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "curves.png",
    "checkpoints",
    "final",
    "tensorboard",
    "wandb",
)
ABORTED = "aborted"
_STEP_DIR = re.compile(r"step_(\d+)")
_NO_SPACE = {errno.ENOSPC: os.strerror(errno.ENOSPC), errno.EDQUOT: os.strerror(errno.EDQUOT)}
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the umask: mkstemp/mkdtemp create 0600/0700, a plain file or folder is 0666/0777 - umask


class RunError(ValueError):
    """A run that cannot go on; the message says why and what to do."""


class NoSpaceError(RunError):
    """The device holding the run directory is full (ENOSPC) or over quota (EDQUOT)."""


# ------------------------------------------------------------------------------ lock
class RunLock:
    """An exclusive `flock` on RUN_DIR/.lock, held until `release()` or the end of the process.

    The file holds the PID of the holder, which a refused process names."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self._file = open(self.path, "a+")  # "a+": opening does not erase the holder's PID
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RunError(
                f"{run_dir} is in use by another gppo process (PID {holder}, which holds {self.path}): "
                "wait for it to finish or stop it, or choose another --output_dir"
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    @property
    def held(self) -> bool:
        return not self._file.closed

    def release(self) -> None:
        self._file.close()


# ------------------------------------------------------------------------------ durable writes
def is_no_space(err: BaseException | None) -> bool:
    """Whether `err`, or an error it wraps, is ENOSPC/EDQUOT. torch and safetensors wrap the OSError
    in a RuntimeError / SafetensorError whose message carries the OS's text."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _NO_SPACE:
            return True
        if any(text in str(err) for text in _NO_SPACE.values()):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def no_space_is_an_error(path: Path, consequence: str = ""):
    """Turn a full disk while writing `path` into a NoSpaceError that names it."""
    try:
        yield
    except Exception as err:
        if not is_no_space(err):
            raise
        raise NoSpaceError(
            f"no space left on device at {path}{consequence}: free some space "
            f"({shutil.disk_usage(path.parent).free // 2**20} MiB free now)"
        ) from err


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, then `root`."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through an fsynced temporary file, a rename and an fsync of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}-")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)
        with no_space_is_an_error(path), os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_dir(target: Path, write, consequence: str = "", manifest: bool = False) -> Path:
    """Create directory `target` whole or not at all: `write(tmp)` fills a temporary sibling, which
    is fsynced and renamed to `target` (an existing `target` is replaced)."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{TEMP_PREFIX}{target.name}-"))
    try:
        tmp.chmod(0o777 & ~_UMASK)
        with no_space_is_an_error(target, consequence):
            write(tmp)
            if manifest:
                sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
                (tmp / MANIFEST).write_text(json.dumps({"files": sizes}, indent=1) + "\n")
            fsync_tree(tmp)
            _rename_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _rename_dir(new: Path, target: Path) -> None:
    """Rename directory `new` to `target`. A directory cannot be renamed over a non-empty one, so an
    existing `target` is first moved into a temporary folder, and put back if the rename fails."""
    if not target.exists():
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{TEMP_PREFIX}old-{target.name}-"))
    os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old / target.name, target)
        old.rmdir()
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old)


def remove_stale_temps(run_dir: Path) -> list[Path]:
    """Remove the temporary files and directories a killed process left (call with the lock held)."""
    stale = [
        p for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir() for p in folder.glob(f"{TEMP_PREFIX}*")
    ]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return stale


def set_aside(run_dir: Path) -> Path | None:
    """Move the files of an attempt that left no usable checkpoint to RUN_DIR/aborted/<UTC time>/
    (kept, not deleted: they are the only record of why that attempt stopped). Returns that folder,
    or None when there was nothing to move."""
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = run_dir / ABORTED / stamp, 1
    while dest.exists():
        n += 1
        dest = run_dir / ABORTED / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for path in present:
        os.replace(path, dest / path.name)
    fsync_dir(dest)
    fsync_dir(run_dir)
    return dest


# ------------------------------------------------------------------------------ checkpoints
def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _step_of(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if p.is_dir() and (step := _step_of(p.name)) is not None)


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, keep: int) -> Path:
    """Write checkpoints/step_<step>/ whole, point `latest` at it, then prune.

    Pruning keeps the new checkpoint and the `keep - 1` newest older ones (all of them for keep=0),
    and removes those newer than it: they belong to a continuation that was abandoned (a resume
    from an earlier checkpoint), so the checkpoint `latest` names is never among those removed."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    previous = latest_checkpoint(run_dir)
    kept = f"; the last good checkpoint {previous} is intact" if previous else "; no checkpoint was written yet"

    def write(tmp: Path) -> None:
        save_model(model, tmp)
        tokenizer.save_pretrained(tmp)
        with open(tmp / "trainer_state.pt", "wb") as f:  # a file object: torch then keeps the OSError's errno
            torch.save({**state, "step": step, "rng": rng_state()}, f)

    final = write_dir(root / f"step_{step:06d}", write, kept, manifest=True)
    atomic_write_text(root / "latest", final.name)
    dirs = _step_dirs(root)
    older = [p for s, p in dirs if s < step]
    remove = [p for s, p in dirs if s > step]
    if keep > 0:
        remove += older[: max(0, len(older) - (keep - 1))]
    for path in remove:
        shutil.rmtree(path)
    return final


def save_final(run_dir: Path, model, tokenizer, name: str = "final") -> Path:
    """Write RUN_DIR/<name>/ (model, or a LoRA adapter, and tokenizer) whole, replacing an earlier one."""

    def write(tmp: Path) -> None:
        save_model(model, tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir(run_dir / name, write, "; the checkpoints are intact, resume to write final/ again")


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """The checkpoint `latest` names, then the older ones, newest first (none without `latest`)."""
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return []
    name = pointer.read_text().strip()
    newest = _step_of(name)
    older = [p for s, p in reversed(_step_dirs(root)) if newest is None or s < newest]
    return [root / name, *older] if newest is not None else older


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint directory `path` cannot be used (missing or truncated files, bad JSON), or None."""
    if not path.is_dir():
        return "it does not exist"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST} is missing or unreadable ({err})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes instead of {size} (truncated or overwritten)"
        if name.endswith(".json"):
            try:
                json.loads(file.read_text())
            except ValueError as err:
                return f"{name} is not valid JSON ({err})"
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that passes `checkpoint_problem`, or None."""
    return next((p for p in checkpoint_candidates(run_dir) if checkpoint_problem(p) is None), None)


def load_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """(path, trainer state) of the newest usable checkpoint, warning about each newer one skipped."""
    skipped = []
    for path in checkpoint_candidates(run_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            try:
                state = torch.load(path / "trainer_state.pt", weights_only=False)
            except Exception as err:  # a damaged pickle or zip raises whatever its reader meets
                problem = f"trainer_state.pt does not load ({type(err).__name__}: {err})"
        if problem is not None:
            skipped.append(f"{path.name}: {problem}")
            continue
        if skipped:
            warnings.warn(
                f"skipped unusable checkpoints in {path.parent} ({'; '.join(skipped)}); falling back to {path.name}",
                RuntimeWarning,
                stacklevel=2,
            )
        return path, state
    if skipped:
        warnings.warn(
            f"no usable checkpoint in {run_dir / 'checkpoints'} ({'; '.join(skipped)})", RuntimeWarning, stacklevel=2
        )
    return None


def continue_hint(run_dir: Path) -> str:
    """How to continue a run that stopped: from its last checkpoint, or from scratch."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return (
            f"no checkpoint was written yet: run the same command again (this attempt's files are then "
            f"moved to {run_dir}/aborted/)"
        )
    return f"continue from {checkpoint.name} with `gppo train --resume {run_dir}`"


def resume_with_lower_lr(run_dir: Path, lr: float) -> str:
    """How to go on after training diverged: from the last good checkpoint, at a tenth of `lr`."""
    lower = f"--lr {lr / 10:g}"
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return (
            f"no checkpoint was written yet: start the run again with a lower learning rate (e.g. {lower}); "
            f"the files of this attempt are then moved to {run_dir}/aborted/"
        )
    return (
        f"the last good checkpoint is {checkpoint}: resume from it with a lower learning rate, "
        f"e.g. `gppo train --resume {run_dir} {lower}`"
    )
