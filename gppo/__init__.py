"""gppo: Generalized Proximal Policy Optimization for LLM reinforcement learning.

One design space, Divergence x Estimator x trust-region rule, in which PPO/GRPO, DAPO, DPPO, RIPO,
GSPO, GMPO, CISPO, SAPO, DCPO and TRM are presets. The public API is the objective:

    loss, metrics = gppo.policy_loss(gppo.TokenBatch(...), gppo.preset("dppo-binary-tv"))

`register_divergence`, `register_estimator` and `register_rule` add points to the space
(docs/extending.md).
"""

from gppo.core import (
    DIVERGENCES,
    ESTIMATORS,
    PRESETS,
    RULES,
    Divergence,
    Estimator,
    GPPOConfig,
    GPPOConfigError,
    GPPOInputError,
    Preset,
    Rule,
    RuleContext,
    RuleOutput,
    TokenBatch,
    TokenStats,
    aggregate,
    divergence,
    estimate,
    gather_logp,
    logits_stats,
    policy_loss,
    preset,
    reference_kl,
    register_divergence,
    register_estimator,
    register_rule,
    token_stats,
)

__version__ = "0.2.0"

__all__ = [
    "DIVERGENCES",
    "ESTIMATORS",
    "PRESETS",
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
    "divergence",
    "estimate",
    "gather_logp",
    "logits_stats",
    "policy_loss",
    "preset",
    "reference_kl",
    "register_divergence",
    "register_estimator",
    "register_rule",
    "token_stats",
    "__version__",
]
