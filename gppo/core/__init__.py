"""The GPPO objective: pure tensor math (PyTorch only, no I/O, no trainer imports).

Everything outside `gppo.core` imports the names below, never a submodule of core."""

from gppo.core.batch import GPPOInputError, TokenBatch, gather_logp
from gppo.core.config import GPPOConfig, GPPOConfigError
from gppo.core.divergences import DIVERGENCES, Divergence, divergence
from gppo.core.estimators import ESTIMATORS, Estimator, register_estimator
from gppo.core.loss import Q_BUCKETS, aggregate, estimate, policy_loss, q_buckets, reference_kl
from gppo.core.params import PARAM_DEFAULTS
from gppo.core.presets import PRESETS, Preset, drop_unused, preset
from gppo.core.registered_divergences import register_divergence
from gppo.core.registry import closest
from gppo.core.rules import RULES, Rule, RuleContext, RuleOutput, register_rule
from gppo.core.token_stats import CHUNK_ELEMENTS, TokenStats, logits_stats, token_stats
from gppo.core.vocab import log_normalize_

__all__ = [
    "CHUNK_ELEMENTS",
    "DIVERGENCES",
    "ESTIMATORS",
    "PARAM_DEFAULTS",
    "PRESETS",
    "Q_BUCKETS",
    "RULES",
    "Divergence",
    "Estimator",
    "GPPOConfig",
    "GPPOConfigError",
    "GPPOInputError",
    "Preset",
    "Rule",
    "RuleContext",
    "RuleOutput",
    "TokenBatch",
    "TokenStats",
    "aggregate",
    "closest",
    "divergence",
    "drop_unused",
    "estimate",
    "gather_logp",
    "log_normalize_",
    "logits_stats",
    "policy_loss",
    "preset",
    "q_buckets",
    "reference_kl",
    "register_divergence",
    "register_estimator",
    "register_rule",
    "token_stats",
]
