"""`PRESETS`: the named methods as data, one table of points of the design space (docs/design.md
section 5), in the role of verl's `core_algos` registry. `preset(name, **overrides)` builds a
validated `GPPOConfig` from an entry, dropping preset parameters that an overridden point no
longer uses; `drop_unused` does the same for commands that apply one set of settings to many
points (a sweep grid).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gppo.core.config import GPPOConfig, GPPOConfigError
from gppo.core.divergences import DIVERGENCES
from gppo.core.estimators import ESTIMATORS
from gppo.core.params import PARAM_FIELDS
from gppo.core.registry import closest
from gppo.core.rules import RULES


@dataclass(frozen=True)
class Preset:
    """A named point of the space: `fields` override GPPOConfig's defaults."""

    name: str
    summary: str
    source: str
    fields: MappingProxyType

    def config(self, **overrides) -> GPPOConfig:
        return preset(self.name, **overrides)


_GMPO_EPS = 0.4  # GMPO clips log r to [-0.4, 0.4]: as a TV x sample region, r in [e^-eps, e^eps]
_NO_REGION = {"divergence": None, "estimator": None}

# name: (summary, source, fields). PPO's epsilon is a TV radius delta = epsilon / 2 per side,
# because 1/2 |r - 1| <= delta  <=>  r in [1 - 2 delta, 1 + 2 delta] (docs/design.md section 4).
_TABLE = {
    "ppo": (
        "PPO clip, eps=0.2",
        "Schulman et al. 2017",
        dict(divergence="tv", estimator="sample", rule="clip", delta_low=0.1, delta_high=0.1),
    ),
    "grpo": (
        "PPO clip with GRPO's sequence-mean aggregation (KL penalty off; DeepSeekMath used kl_coef=0.04)",
        "Shao et al. 2024 (2402.03300)",
        dict(
            divergence="tv",
            estimator="sample",
            rule="clip",
            delta_low=0.1,
            delta_high=0.1,
            loss_agg_mode="seq-mean-token-mean",
        ),
    ),
    "dapo": (
        "clip-higher: eps_low=0.2, eps_high=0.28, token-mean",
        "Yu et al. 2025 (2503.14476)",
        dict(divergence="tv", estimator="sample", rule="clip", delta_low=0.1, delta_high=0.14),
    ),
    "dppo-binary-tv": (
        "directional mask on binary TV |p-q| > 0.15",
        "DPPO (2602.04879)",
        dict(divergence="tv", estimator="binary", rule="mask", delta_low=0.15, delta_high=0.15),
    ),
    "dppo-binary-kl": (
        "directional mask on binary KL > 0.05",
        "DPPO (2602.04879)",
        dict(divergence="kl", estimator="binary", rule="mask", delta_low=0.05, delta_high=0.05),
    ),
    "dppo-topk-tv": (
        "directional mask on top-20 TV > 0.15",
        "DPPO (2602.04879)",
        dict(divergence="tv", estimator="topk", rule="mask", top_k=20, delta_low=0.15, delta_high=0.15),
    ),
    "dppo-topk-kl": (
        "directional mask on top-20 KL > 0.05",
        "DPPO (2602.04879)",
        dict(divergence="kl", estimator="topk", rule="mask", top_k=20, delta_low=0.05, delta_high=0.05),
    ),
    "ripo": (
        "clip to the chi^2 cell q (r-1)^2 <= 0.05, i.e. |r-1| <= sqrt(delta/q)",
        "RIPO (2607.10169)",
        dict(divergence="chi2", estimator="cell", rule="clip", delta_low=0.05, delta_high=0.05),
    ),
    "gspo": (
        "clip of the sequence ratio exp(mean_t log r), eps 3e-4 / 4e-4",
        "Zheng et al. 2025 (2507.18071)",
        dict(
            divergence="tv",
            estimator="sample",
            rule="seq-clip",
            delta_low=1.5e-4,
            delta_high=2e-4,
            loss_agg_mode="seq-mean-token-mean",
        ),
    ),
    "gmpo": (
        "geometric-mean sequence weight, log r clipped to +-0.4 in the harmful direction",
        "Zhao et al. 2025 (2507.20673)",
        dict(
            divergence="tv",
            estimator="sample",
            rule="geo-mean",
            delta_low=(1 - math.exp(-_GMPO_EPS)) / 2,
            delta_high=(math.exp(_GMPO_EPS) - 1) / 2,
            loss_agg_mode="seq-mean-token-mean",
        ),
    ),
    "cispo": (
        "no mask; truncated IS weight sg[min(r, 5)] on log p",
        "MiniMax-M1 (2506.13585)",
        dict(_NO_REGION, rule="truncate", truncation=5.0),
    ),
    "pg-is": (
        "no region; importance-weighted PG, weight sg[min(r, 10)] on log p",
        "DPPO (2602.04879) sanity test; C = its code's clip_ratio_c",
        dict(_NO_REGION, rule="truncate", truncation=10.0),
    ),
    "minirl": (
        "PPO clip eps=0.2 around the recomputed pi_old, times sg[min(pi_old/mu, 10)]",
        "MiniRL, Zheng et al. 2025 (2512.01374)",
        dict(
            divergence="tv",
            estimator="sample",
            rule="clip",
            delta_low=0.1,
            delta_high=0.1,
            anchor="old",
            behavior_weight_cap=10.0,
        ),
    ),
    "sapo": (
        "soft gate sigma(tau (r-1)) 4/tau, tau 1.0 / 1.05, sequence-mean",
        "SAPO (2511.20347)",
        dict(_NO_REGION, rule="soft", tau_pos=1.0, tau_neg=1.05, loss_agg_mode="seq-mean-token-mean"),
    ),
    "dcpo": (
        "clip with probability-dependent bounds, eps 0.16 / 0.2",
        "DCPO (2509.02333)",
        dict(_NO_REGION, rule="clip", clip_bounds="dcpo", delta_low=0.16, delta_high=0.2),
    ),
    "trm": (
        "drop a whole sequence when max_t KL (k3) > 0.05; IS-weighted PG otherwise",
        "Trust Region Masking (2512.23075)",
        dict(divergence="kl", estimator="sample", rule="seq-mask", seq_reduce="max", delta_high=0.05),
    ),
    # verl 0.9.1's policy-loss registry (core_algos.py), each checked against verl's own function.
    "gpg": (
        "-A log p: policy gradient without importance weight or region",
        "GPG, Chu et al. 2025 (2504.02546); verl loss_mode gpg",
        dict(_NO_REGION, rule="pg"),
    ),
    "clip-cov": (
        "PPO clip eps=0.2; gradient detached on a random 2e-4 of the tokens whose "
        "covariance (A - mean A)(log p - mean log p) lies in (1, 5)",
        "Cui et al. 2025 (2505.22617); verl loss_mode clip_cov with its defaults",
        dict(
            divergence="tv",
            estimator="sample",
            rule="clip-cov",
            delta_low=0.1,
            delta_high=0.1,
            cov_ratio=2e-4,
            cov_low=1.0,
            cov_high=5.0,
        ),
    ),
    "kl-cov": (
        "-A r, plus 0.1 |log r| on the 2e-4 of the tokens of largest covariance",
        "Cui et al. 2025 (2505.22617); verl loss_mode kl_cov with its defaults",
        dict(_NO_REGION, rule="kl-cov", cov_ratio=2e-4, cov_kl_coef=0.1),
    ),
    # verl requires dro_beta and sets none; 0.05 is the value Tinker's DRO documentation passes.
    "dro": (
        "-(A log p - (beta/2)(log r)^2), beta = 0.05",
        "DRO, Richemond et al. 2024 (2405.19107); verl loss_mode dro",
        dict(_NO_REGION, rule="pg", kl_tau=0.025),
    ),
    # TRL 1.16 GRPOConfig.loss_type, each checked against GRPOTrainer._compute_loss. bnpo is ppo's
    # point with a micro-batch normaliser (docs/library.md), not a point of its own.
    "dr-grpo": (
        "PPO clip eps=0.2, sum over tokens / (sequences x constant length)",
        "Dr. GRPO, Liu et al. 2025 (2503.20783); TRL loss_type dr_grpo",
        dict(
            divergence="tv",
            estimator="sample",
            rule="clip",
            delta_low=0.1,
            delta_high=0.1,
            loss_agg_mode="seq-mean-token-sum-norm",
        ),
    ),
    # LUSPO changes only GSPO's aggregation (each sequence's loss times its length); the paper
    # gives no clip range of its own, so GSPO's is kept.
    "luspo": (
        "GSPO's sequence-ratio clip (eps 3e-4 / 4e-4), each sequence's loss times its length",
        "LUSPO, Liu et al. 2026 (2602.05261); TRL loss_type luspo",
        dict(
            divergence="tv",
            estimator="sample",
            rule="seq-clip",
            delta_low=1.5e-4,
            delta_high=2e-4,
            loss_agg_mode="seq-mean-token-sum",
        ),
    ),
    "vespo": (
        "-sg[phi(w)] A log p, phi(w) = w^k e^(lambda (1 - w)) of the sequence ratio w, "
        "(k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0",
        "VESPO (2602.10693); TRL loss_type vespo with its defaults",
        dict(_NO_REGION, rule="gamma", k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0),
    ),
    "prime-dppo-kl": (
        "directional mask on binary TV > 0.2, plus 1e-3 (log r)^2 on every token",
        "prime-rl's default loss (DPPO binary TV + Kimi K2.5's KL term)",
        dict(divergence="tv", estimator="binary", rule="mask", delta_low=0.2, delta_high=0.2, kl_tau=1e-3),
    ),
    # IcePop read as verl's bypass_pg_token_icepop (two policies: r = pi / mu): tokens with r
    # outside [0.5, 5] get no gradient, the others -sg[r] A log p. truncation = 5 never binds on
    # a kept token; it selects that sg[r] log p form of the loss.
    "icepop": (
        "drop every token whose ratio pi/mu leaves [0.5, 5]; -sg[r] A log p on the others",
        "IcePop (Ring-1T, 2510.18855); verl bypass_pg_token_icepop",
        dict(divergence="tv", estimator="sample", rule="band", delta_low=0.25, delta_high=2.0, truncation=5.0),
    ),
    # The DPPO authors' successors, read from the papers and the authors' code (UniRL). CPPO: the
    # paper's matched top-20 TV and dense-model delta 0.15, w_min 0.8 and the fixed delta_b 0.015 of
    # its post-trained model (its Base models: prefix_budget_mode='p90' with their floors);
    # aggregation unstated, verl's token-mean kept. DRPO: delta 12.5 (its section 4) and the
    # authors' recipe's seq-mean-token-sum-norm.
    "cppo": (
        "directional mask on top-20 TV with threshold 0.15 / w_t (w_t from 1 down to 0.8 along "
        "the response) and prefix budget 0.015",
        "CPPO, Mao et al. 2026 (2606.10968)",
        dict(
            divergence="tv",
            estimator="topk",
            rule="prefix-mask",
            top_k=20,
            delta_high=0.15,
            position_weight_min=0.8,
            prefix_budget=0.015,
            prefix_budget_mode="fixed",
        ),
    ),
    "drpo": (
        "-A r + |A| q (r-1)^2 / (2 * 12.5): DPPO's binary-TV region as a smooth penalty",
        "DRPO, Yao et al. 2026 (2606.09821); the authors' UniRL recipe",
        dict(_NO_REGION, rule="quadratic", quadratic_delta=12.5, loss_agg_mode="seq-mean-token-sum-norm"),
    ),
    # Our recommended default: DPPO's binary-TV point, a lower bound of the true TV that, unlike
    # PPO's single-sample ratio, lets rare tokens move (|p - q| <= delta instead of |r - 1| <= eps),
    # needs only the sampled token's log-prob (so it runs inside verl and TRL unchanged), and is
    # anchored to the rollout log-probs mu. Evidence (docs/results.md, embedded tasks, 3-6 seeds):
    # no divergence or estimator beat it beyond seed noise; top-K had a small AUC edge (+0.02,
    # not significant) but needs top-K log-probs that verl does not provide.
    "gppo": (
        "recommended: directional mask on binary TV > 0.15, anchored to mu",
        "this project (see docs/results.md)",
        dict(divergence="tv", estimator="binary", rule="mask", delta_low=0.15, delta_high=0.15),
    ),
}

PRESETS: MappingProxyType = MappingProxyType(
    {
        name: Preset(name, summary, source, MappingProxyType(values))
        for name, (summary, source, values) in _TABLE.items()
    }
)


def preset(name: str, **overrides) -> GPPOConfig:
    """The preset `name` as a validated GPPOConfig, with `overrides` applied field by field.

    Preset parameters that the overridden point does not use are dropped (e.g. top_k of
    dppo-topk-tv with estimator='binary'); an override the point does not use is an error."""
    if name not in PRESETS:
        raise GPPOConfigError(f"unknown preset {name!r}{closest(name, PRESETS)}; choose one of {list(PRESETS)}")
    valid = GPPOConfig.field_names()
    for key in overrides:
        if key not in valid:
            raise GPPOConfigError(f"unknown GPPOConfig field {key!r}{closest(key, valid)}; fields are {valid}")
    values = {**PRESETS[name].fields, **overrides}
    kept = _used_params(values)
    return GPPOConfig(
        **{k: v for k, v in values.items() if k in overrides or k not in PARAM_FIELDS or kept is None or k in kept}
    )


def drop_unused(values: Mapping) -> dict:
    """`values` (flat keys; GPPOConfig fields among them) without the parameters that their point
    does not use: for commands that apply one set of settings to many points (a sweep grid)."""
    used = _used_params(values)
    return {k: v for k, v in values.items() if k not in PARAM_FIELDS or used is None or k in used}


def _used_params(values: Mapping) -> set[str] | None:
    """The parameters the point in `values` uses, or None when the point is invalid (GPPOConfig
    then says why). The rule's own parameters are kept: they may decide whether it uses an estimate."""
    try:
        rule = RULES.lookup(values.get("rule", GPPOConfig.rule))
        names = set(GPPOConfig.field_names()) - set(PARAM_FIELDS) | set(rule.params)
        point = GPPOConfig(**{k: v for k, v in values.items() if k in names})
    except (GPPOConfigError, ValueError, TypeError):
        return None
    used = set(rule.params)
    if point.uses_estimate:
        used |= set(ESTIMATORS.lookup(point.estimator).params)
        used |= set(DIVERGENCES.lookup(point.divergence).params)
    return used
