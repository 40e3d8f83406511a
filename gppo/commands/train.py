"""`gppo train`: one RL run (its options are `gppo.trainer.TrainConfig`'s fields)."""

from __future__ import annotations

from gppo.options import ArgumentParser
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.config import add_config_arguments, config_values, from_dict


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gppo train",
        description="Run GPPO reinforcement learning. With no arguments: the embedded tiny Qwen2, warm-started on "
        "3-digit addition, trained with the `gppo` preset (a few minutes on a CPU).",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint "
        "(flags given with it override the saved config, e.g. a larger --steps)",
    )
    add_config_arguments(p)
    return p


def run(args) -> int:
    values = config_values(args)
    resume = getattr(args, "resume", None)
    if resume and "output_dir" in values:
        raise ConfigError(
            f"--output_dir would be ignored with --resume: the run continues in {resume}; remove --output_dir"
        )
    trainer = Trainer.resume(resume, values) if resume else Trainer(from_dict(values))
    trainer.train()
    return 0
