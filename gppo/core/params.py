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


PARAMS = MappingProxyType({
    "alpha": Param(None, "alpha of divergence 'alpha'"),
    "delta_low": Param(0.1, "radius for tokens whose probability the update lowers (A<0, r<1)"),
    "delta_high": Param(0.1, "radius for tokens whose probability the update raises (A>0, r>1); "
                             "sequence rules use it as their single radius"),
    "top_k": Param(20, "K of mu's top-K recorded at rollout"),
    "top_p": Param(0.95, "nucleus mass P"),
    "truncation": Param(None, "cap C on the importance weight min(r, C) (CISPO/TIS); None disables"),
    "dual_clip": Param(None, "dual-clip constant c > 1 for A<0; None disables"),
    "clip_bounds": Param("region", "ratio interval of rule clip: 'region' (from divergence x "
                                   "estimator x delta) or 'dcpo' (DCPO's probability-dependent "
                                   "bounds, eps = delta)"),
    "tau_pos": Param(1.0, "SAPO gate temperature for A>0"),
    "tau_neg": Param(1.05, "SAPO gate temperature for A<0"),
    "seq_reduce": Param("max", "reduce token divergences of a sequence by 'max' or 'mean'"),
})
PARAM_FIELDS = tuple(PARAMS)
PARAM_DEFAULTS = MappingProxyType({name: param.default for name, param in PARAMS.items()})


def check_params(owner: str, params) -> None:
    """A registry entry may declare only parameters of this table."""
    bad = [p for p in params if p not in PARAMS]
    if bad:
        raise ValueError(f"{owner} declares parameters {bad}, which are not GPPOConfig parameter "
                         f"fields; choose among {list(PARAM_FIELDS)}")
