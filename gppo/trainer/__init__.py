"""The single-process RL trainer built on the GPPO objective (`gppo train`)."""

from gppo.trainer.checkpoint import RunError
from gppo.trainer.config import ConfigError, TrainConfig
from gppo.trainer.trainer import Trainer

__all__ = ["ConfigError", "RunError", "TrainConfig", "Trainer"]
