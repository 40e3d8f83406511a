"""The GPPO objective: pure tensor math (PyTorch only, no I/O, no trainer imports)."""

from gppo.core.batch import GPPOInputError, TokenBatch, gather_logp
from gppo.core.config import PRESETS, GPPOConfig, GPPOConfigError, Preset, preset
from gppo.core.divergences import DIVERGENCES, Divergence, divergence
from gppo.core.estimators import ESTIMATORS
from gppo.core.loss import aggregate, estimate, policy_loss, reference_kl
from gppo.core.rules import RULES

__all__ = [
    "DIVERGENCES", "ESTIMATORS", "PRESETS", "RULES", "Divergence", "GPPOConfig",
    "GPPOConfigError", "GPPOInputError", "Preset", "TokenBatch", "aggregate", "divergence",
    "estimate", "gather_logp", "policy_loss", "preset", "reference_kl",
]
