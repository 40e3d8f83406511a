"""The parameters of the design space: one table of name -> (default, meaning).

A registry entry (divergence, estimator, rule) declares which of these it reads; `GPPOConfig` has one
field for each, unset (None) until the point uses it. This module imports nothing from gppo, so the
registries check their declarations here without importing `config` (which imports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Param:
    default: object  # taken when the point uses the parameter and it is unset; None: no default
    help: str


PARAMS = MappingProxyType(
    {
        "alpha": Param(None, "alpha of divergence 'alpha'"),
        "delta_low": Param(0.1, "radius for tokens whose probability the update lowers (A<0, r<1)"),
        "delta_high": Param(
            0.1,
            "radius for tokens whose probability the update raises (A>0, r>1); "
            "sequence rules use it as their single radius",
        ),
        "top_k": Param(20, "K of mu's top-K recorded at rollout"),
        "top_p": Param(0.95, "nucleus mass P"),
        "truncation": Param(None, "cap C on the importance weight min(r, C) (CISPO/TIS); None disables"),
        "dual_clip": Param(None, "dual-clip constant c > 1 for A<0; None disables"),
        "clip_bounds": Param(
            "region",
            "ratio interval of rule clip: 'region' (from divergence x "
            "estimator x delta) or 'dcpo' (DCPO's probability-dependent "
            "bounds, eps = delta)",
        ),
        "tau_pos": Param(1.0, "SAPO gate temperature for A>0"),
        "tau_neg": Param(1.05, "SAPO gate temperature for A<0"),
        "seq_reduce": Param("max", "reduce token divergences of a sequence by 'max' or 'mean'"),
        "kl_tau": Param(
            None,
            "coefficient tau of the penalty tau (log r)^2 on every token (prime-rl's "
            "kl_tau; DRO's beta / 2); None disables",
        ),
        "cov_ratio": Param(
            0.0002,
            "fraction of the batch's tokens that Clip-Cov / KL-Cov select by the "
            "covariance (A - mean A)(log p - mean log p)",
        ),
        "cov_low": Param(1.0, "Clip-Cov: only tokens whose covariance lies in (cov_low, cov_high) are candidates"),
        "cov_high": Param(5.0, "Clip-Cov: upper end of the candidates' covariance band"),
        "cov_kl_coef": Param(0.1, "KL-Cov: coefficient of the penalty |log r| on the selected tokens"),
        "k_pos": Param(2.0, "VESPO: power k of the gamma weight w^k e^(lambda (1 - w)) for A >= 0"),
        "lambda_pos": Param(3.0, "VESPO: decay lambda of the gamma weight for A >= 0"),
        "k_neg": Param(3.0, "VESPO: power k of the gamma weight for A < 0"),
        "lambda_neg": Param(2.0, "VESPO: decay lambda of the gamma weight for A < 0"),
        "off_policy_threshold": Param(
            None,
            "DeepSeek-V3.2's off-policy sequence mask: tokens with A < 0 "
            "of a sequence whose mean log(mu / pi) exceeds it get no "
            "gradient; None disables",
        ),
        "position_weight_min": Param(
            0.8,
            "CPPO: floor w_min of the position weight w_t = 1 - (1 - w_min)(t - 1)/(T - 1), T the response's length",
        ),
        "prefix_budget": Param(
            0.015,
            "CPPO: prefix-average threshold delta_b of the weighted estimates "
            "(with prefix_budget_mode 'p90': its floor)",
        ),
        "prefix_budget_mode": Param(
            "fixed",
            "CPPO: 'fixed' delta_b, or 'p90': per response clamp(90th percentile of its estimates, delta_b, 2 delta_b)",
        ),
        "quadratic_delta": Param(
            12.5, "DRPO: threshold delta of the penalty |A| q (r - 1)^2 / (2 delta), q the anchor's probability"
        ),
    }
)
PARAM_FIELDS = tuple(PARAMS)
PARAM_DEFAULTS = MappingProxyType({name: param.default for name, param in PARAMS.items()})


def check_params(owner: str, params) -> None:
    """A registry entry may declare only parameters of this table."""
    bad = [p for p in params if p not in PARAMS]
    if bad:
        raise ValueError(
            f"{owner} declares parameters {bad}, which are not GPPOConfig parameter "
            f"fields; choose among {list(PARAM_FIELDS)}"
        )
