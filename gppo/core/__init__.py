"""The GPPO objective: pure tensor math (PyTorch only, no I/O, no trainer imports)."""

from gppo.core.batch import GPPOInputError, TokenBatch, gather_logp
from gppo.core.config import PRESETS, GPPOConfig, GPPOConfigError, Preset, preset
from gppo.core.divergences import DIVERGENCES, Divergence, divergence, register_divergence
from gppo.core.estimators import ESTIMATORS, Estimator, register_estimator
from gppo.core.loss import aggregate, estimate, policy_loss, reference_kl
from gppo.core.rules import RULES, Rule, RuleContext, RuleOutput, register_rule

__all__ = [
    "DIVERGENCES", "ESTIMATORS", "PRESETS", "RULES", "Divergence", "Estimator", "GPPOConfig",
    "GPPOConfigError", "GPPOInputError", "Preset", "Rule", "RuleContext", "RuleOutput", "TokenBatch",
    "aggregate", "divergence", "estimate", "gather_logp", "policy_loss", "preset", "reference_kl",
    "register_divergence", "register_estimator", "register_rule",
]
