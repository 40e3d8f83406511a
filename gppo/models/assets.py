"""The shipped warm starts of the embedded model: `gppo/assets/warmstart/<task>/` (HF format).

`gppo warmstart` (gppo/commands/warmstart.py) produced them; each folder's `warmstart.json`
holds its settings, wall time and held-out accuracies.
"""

from __future__ import annotations

from pathlib import Path

from gppo.tasks import get_task

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "warmstart"


def embedded_checkpoint(task_name: str = "addition") -> Path:
    """Folder of the shipped warm start for `task_name`."""
    if not getattr(get_task(task_name), "embedded_model", True):  # also validates the name
        raise ValueError(
            f"task {task_name!r} is written for pretrained instruct models, not the embedded "
            "character-level model: give --model (an HF directory or a .gguf file)"
        )
    shipped = ASSETS / task_name
    if not (shipped / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped warm start of task {task_name!r} is missing from {shipped} (a broken install?): "
            f"reinstall gppo, or train one with `gppo warmstart --task {task_name} --out DIR` and pass --model DIR"
        )
    return shipped
