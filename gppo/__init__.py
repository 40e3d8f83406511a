"""gppo: Generalized Proximal Policy Optimization for LLM reinforcement learning.

One design space, Divergence x Estimator x trust-region rule, in which PPO/GRPO, DAPO, DPPO, RIPO,
GSPO, GMPO, CISPO, SAPO, DCPO and TRM are presets. The public API is the objective:

    loss, metrics = gppo.policy_loss(gppo.TokenBatch(...), gppo.preset("dppo-binary-tv"))
"""

from gppo.core import (
    DIVERGENCES,
    ESTIMATORS,
    PRESETS,
    RULES,
    Divergence,
    GPPOConfig,
    GPPOConfigError,
    GPPOInputError,
    Preset,
    TokenBatch,
    aggregate,
    divergence,
    estimate,
    gather_logp,
    policy_loss,
    preset,
    reference_kl,
)

__version__ = "0.1.0"

__all__ = [
    "DIVERGENCES", "ESTIMATORS", "PRESETS", "RULES", "Divergence", "GPPOConfig",
    "GPPOConfigError", "GPPOInputError", "Preset", "TokenBatch", "aggregate", "divergence",
    "estimate", "gather_logp", "policy_loss", "preset", "reference_kl", "__version__",
]
