"""`GPPOConfig` (one point of the design space) and `PRESETS` (the named methods, as data).

A preset is a point Divergence x Estimator x Rule plus defaults (DESIGN.md section 5), listed in
the single table `PRESETS`; `preset(name, **overrides)` builds a validated `GPPOConfig` from it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType

from gppo.core.divergences import DIVERGENCES, closest, divergence


class GPPOConfigError(ValueError):
    """An invalid point of the design space; the message names the field and the fix."""


RULES = ("mask", "clip", "soft", "truncate", "seq-clip", "geo-mean", "seq-mask")
ESTIMATOR_NAMES = ("sample", "cell", "binary", "topk", "topp", "full")
ANCHORS = ("behavior", "old")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "full")
CLIP_BOUNDS = ("region", "dcpo")
SEQ_REDUCES = ("max", "mean")

# Estimators whose trust region is an interval of the sampled token's ratio (it depends only on
# p and q), which the clip-style rules need.
RATIO_INTERVAL_ESTIMATORS = ("sample", "cell", "binary")

_RULE_NEEDS = {
    # rule: (uses a divergence estimate, estimators allowed; None = any)
    "mask": (True, None),
    "seq-mask": (True, None),
    "clip": (True, RATIO_INTERVAL_ESTIMATORS),
    "geo-mean": (True, RATIO_INTERVAL_ESTIMATORS),
    "seq-clip": (True, ("sample",)),
    "soft": (False, ()),
    "truncate": (False, ()),
}


def _doc(text: str, **kw):
    return field(metadata={"help": text}, **kw)


@dataclass
class GPPOConfig:
    """One point of the GPPO design space. Build it with `gppo.preset(name, **overrides)`."""

    divergence: str | None = _doc("f-divergence of the trust region: " + ", ".join(DIVERGENCES)
                                  + " (None for rules soft/truncate)", default="tv")
    alpha: float = _doc("alpha of divergence='alpha' (ignored otherwise)", default=0.5)
    estimator: str | None = _doc("how D_f is estimated per token: " + ", ".join(ESTIMATOR_NAMES)
                                 + " (None for rules soft/truncate)", default="sample")
    rule: str = _doc("trust-region rule: " + ", ".join(RULES), default="clip")
    delta_low: float = _doc("radius for tokens whose probability the update lowers (A<0, r<1)",
                            default=0.1)
    delta_high: float = _doc("radius for tokens whose probability the update raises (A>0, r>1); "
                             "sequence rules use it as their single radius", default=0.1)
    anchor: str = _doc("trust-region centre: 'behavior' (rollout log-probs mu) or 'old' "
                       "(recomputed pi_old)", default="behavior")
    loss_agg_mode: str = _doc("aggregation: " + ", ".join(LOSS_AGG_MODES), default="token-mean")
    norm_length: int | None = _doc("constant length L of seq-mean-token-sum-norm (None: the "
                                   "batch's T)", default=None)
    top_k: int = _doc("K of estimators topk/topp (mu's top-K recorded at rollout)", default=20)
    top_p: float = _doc("nucleus mass P of estimator topp", default=0.95)
    truncation: float | None = _doc("cap C on the importance weight min(r, C) (CISPO/TIS); None "
                                    "disables", default=None)
    dual_clip: float | None = _doc("dual-clip constant c > 1 for A<0 (rules clip/mask); None "
                                   "disables", default=None)
    clip_bounds: str = _doc("ratio interval of rule clip: 'region' (from divergence x estimator "
                            "x delta) or 'dcpo' (DCPO's probability-dependent bounds, "
                            "eps = delta)", default="region")
    tau_pos: float = _doc("SAPO gate temperature for A>0", default=1.0)
    tau_neg: float = _doc("SAPO gate temperature for A<0", default=1.05)
    seq_reduce: str = _doc("rule seq-mask: reduce token divergences by 'max' or 'mean'",
                           default="max")
    kl_coef: float = _doc("coefficient beta of the KL penalty to the reference model",
                          default=0.0)
    kl_estimator: str = _doc("KL penalty estimator: k1, k2, k3 or full (exact, needs logits)",
                             default="k3")
    behavior_weight_cap: float | None = _doc(
        "anchor='old' only: multiply each token's loss by sg[min(pi_old/mu, cap)] to correct the "
        "rollout/training mismatch (truncated IS); None disables", default=None)
    full_chunk_size: int = _doc("tokens per chunk of estimator 'full' (memory: one chunk of "
                                "[chunk, V] beyond the logits)", default=512)

    def __post_init__(self):
        _validate(self)

    @property
    def divergence_fn(self):
        """The `Divergence` object (None for rules that use none)."""
        if self.divergence is None:
            return None
        params = {"alpha": self.alpha} if self.divergence == "alpha" else {}
        return divergence(self.divergence, **params)

    @property
    def uses_estimate(self) -> bool:
        return _RULE_NEEDS[self.rule][0]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _choice(cfg, name, choices):
    value = getattr(cfg, name)
    if value not in choices:
        raise GPPOConfigError(
            f"GPPOConfig.{name}={value!r} is not valid{closest(value, choices)}; "
            f"choose one of {list(choices)}"
        )


def _validate(cfg: GPPOConfig) -> None:
    _choice(cfg, "rule", RULES)
    _choice(cfg, "anchor", ANCHORS)
    _choice(cfg, "loss_agg_mode", LOSS_AGG_MODES)
    _choice(cfg, "kl_estimator", KL_ESTIMATORS)
    _choice(cfg, "clip_bounds", CLIP_BOUNDS)
    _choice(cfg, "seq_reduce", SEQ_REDUCES)
    uses_estimate, allowed = _RULE_NEEDS[cfg.rule]
    if cfg.rule == "clip" and cfg.clip_bounds == "dcpo":
        uses_estimate, allowed = False, ()
    elif cfg.clip_bounds == "dcpo":
        raise GPPOConfigError("GPPOConfig.clip_bounds='dcpo' applies to rule='clip' only")
    if uses_estimate:
        if cfg.divergence is None or cfg.estimator is None:
            raise GPPOConfigError(
                f"rule {cfg.rule!r} needs a divergence and an estimator (got divergence="
                f"{cfg.divergence!r}, estimator={cfg.estimator!r})"
            )
        _choice(cfg, "estimator", ESTIMATOR_NAMES)
        try:
            divergence(cfg.divergence, **({"alpha": cfg.alpha} if cfg.divergence == "alpha" else {}))
        except ValueError as err:
            raise GPPOConfigError(f"GPPOConfig.divergence: {err}") from None
        if allowed is not None and cfg.estimator not in allowed:
            raise GPPOConfigError(
                f"rule {cfg.rule!r} clips the sampled token's ratio, so it needs an estimator "
                f"whose trust region is a ratio interval ({', '.join(allowed)}); estimator "
                f"{cfg.estimator!r} depends on other tokens. Use rule='mask', which has the same "
                "gradient as clipping, or one of those estimators"
            )
        for name in ("delta_low", "delta_high"):
            value = getattr(cfg, name)
            if not value > 0:  # also rejects NaN
                raise GPPOConfigError(f"GPPOConfig.{name} must be > 0 (got {value})")
    elif cfg.divergence is not None or cfg.estimator is not None:
        what = "DCPO bounds" if cfg.rule == "clip" else f"rule {cfg.rule!r}"
        raise GPPOConfigError(
            f"{what} uses no divergence estimate: set divergence=None and estimator=None "
            f"(got divergence={cfg.divergence!r}, estimator={cfg.estimator!r})"
        )
    if cfg.clip_bounds == "dcpo" and not (cfg.delta_low > 0 and cfg.delta_high > 0):
        raise GPPOConfigError("DCPO bounds need delta_low > 0 and delta_high > 0 (they are eps)")
    if cfg.estimator in ("topk", "topp") and not cfg.top_k >= 1:
        raise GPPOConfigError(f"GPPOConfig.top_k must be >= 1 for estimator {cfg.estimator!r}")
    if not 0 < cfg.top_p <= 1:
        raise GPPOConfigError(f"GPPOConfig.top_p must be in (0, 1] (got {cfg.top_p})")
    if cfg.truncation is not None and not cfg.truncation > 0:
        raise GPPOConfigError(f"GPPOConfig.truncation must be > 0 or None (got {cfg.truncation})")
    if cfg.dual_clip is not None:
        if cfg.rule not in ("clip", "mask"):
            raise GPPOConfigError("GPPOConfig.dual_clip applies to rules 'clip' and 'mask' only")
        if not cfg.dual_clip > 1:
            raise GPPOConfigError(f"GPPOConfig.dual_clip must be > 1 (got {cfg.dual_clip})")
    if not (cfg.tau_pos > 0 and cfg.tau_neg > 0):
        raise GPPOConfigError("GPPOConfig.tau_pos and tau_neg must be > 0")
    if cfg.kl_coef < 0:
        raise GPPOConfigError(f"GPPOConfig.kl_coef must be >= 0 (got {cfg.kl_coef})")
    if cfg.behavior_weight_cap is not None:
        if cfg.anchor != "old":
            raise GPPOConfigError(
                "GPPOConfig.behavior_weight_cap corrects pi_old vs mu and needs anchor='old'; with "
                "anchor='behavior' the ratio already uses mu (use truncation to cap it)"
            )
        if not cfg.behavior_weight_cap > 0:
            raise GPPOConfigError("GPPOConfig.behavior_weight_cap must be > 0")
    if cfg.norm_length is not None and not cfg.norm_length >= 1:
        raise GPPOConfigError(f"GPPOConfig.norm_length must be >= 1 (got {cfg.norm_length})")
    if not cfg.full_chunk_size >= 1:
        raise GPPOConfigError("GPPOConfig.full_chunk_size must be >= 1")


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
# because 1/2 |r - 1| <= delta  <=>  r in [1 - 2 delta, 1 + 2 delta] (DESIGN.md section 4).
_TABLE = {
    "ppo": ("PPO clip, eps=0.2", "Schulman et al. 2017",
            dict(divergence="tv", estimator="sample", rule="clip", delta_low=0.1, delta_high=0.1)),
    "grpo": ("PPO clip with GRPO's sequence-mean aggregation (KL penalty off; DeepSeekMath used "
             "kl_coef=0.04)", "Shao et al. 2024 (2402.03300)",
             dict(divergence="tv", estimator="sample", rule="clip", delta_low=0.1, delta_high=0.1,
                  loss_agg_mode="seq-mean-token-mean")),
    "dapo": ("clip-higher: eps_low=0.2, eps_high=0.28, token-mean", "Yu et al. 2025 (2503.14476)",
             dict(divergence="tv", estimator="sample", rule="clip", delta_low=0.1, delta_high=0.14)),
    "dppo-binary-tv": ("directional mask on binary TV |p-q| > 0.15", "DPPO (2602.04879)",
                       dict(divergence="tv", estimator="binary", rule="mask", delta_low=0.15,
                            delta_high=0.15)),
    "dppo-binary-kl": ("directional mask on binary KL > 0.05", "DPPO (2602.04879)",
                       dict(divergence="kl", estimator="binary", rule="mask", delta_low=0.05,
                            delta_high=0.05)),
    "dppo-topk-tv": ("directional mask on top-20 TV > 0.15", "DPPO (2602.04879)",
                     dict(divergence="tv", estimator="topk", rule="mask", top_k=20,
                          delta_low=0.15, delta_high=0.15)),
    "dppo-topk-kl": ("directional mask on top-20 KL > 0.05", "DPPO (2602.04879)",
                     dict(divergence="kl", estimator="topk", rule="mask", top_k=20,
                          delta_low=0.05, delta_high=0.05)),
    "ripo": ("clip to the chi^2 cell q (r-1)^2 <= 0.05, i.e. |r-1| <= sqrt(delta/q)",
             "RIPO (2607.10169)",
             dict(divergence="chi2", estimator="cell", rule="clip", delta_low=0.05,
                  delta_high=0.05)),
    "gspo": ("clip of the sequence ratio exp(mean_t log r), eps 3e-4 / 4e-4",
             "Zheng et al. 2025 (2507.18071)",
             dict(divergence="tv", estimator="sample", rule="seq-clip", delta_low=1.5e-4,
                  delta_high=2e-4, loss_agg_mode="seq-mean-token-mean")),
    "gmpo": ("geometric-mean sequence weight, log r clipped to +-0.4 in the harmful direction",
             "Zhao et al. 2025 (2507.20673)",
             dict(divergence="tv", estimator="sample", rule="geo-mean",
                  delta_low=(1 - math.exp(-_GMPO_EPS)) / 2,
                  delta_high=(math.exp(_GMPO_EPS) - 1) / 2,
                  loss_agg_mode="seq-mean-token-mean")),
    "cispo": ("no mask; truncated IS weight sg[min(r, 5)] on log p", "MiniMax-M1 (2506.13585)",
              dict(_NO_REGION, rule="truncate", truncation=5.0)),
    "sapo": ("soft gate sigma(tau (r-1)) 4/tau, tau 1.0 / 1.05, sequence-mean", "SAPO (2511.20347)",
             dict(_NO_REGION, rule="soft", tau_pos=1.0, tau_neg=1.05, loss_agg_mode="seq-mean-token-mean")),
    "dcpo": ("clip with probability-dependent bounds, eps 0.16 / 0.2", "DCPO (2509.02333)",
             dict(_NO_REGION, rule="clip", clip_bounds="dcpo", delta_low=0.16, delta_high=0.2)),
    "trm": ("drop a whole sequence when max_t KL (k3) > 0.05; IS-weighted PG otherwise",
            "Trust Region Masking (2512.23075)",
            dict(divergence="kl", estimator="sample", rule="seq-mask", seq_reduce="max",
                 delta_low=0.05, delta_high=0.05)),
    # Our recommended default: DPPO's binary-TV point, a lower bound of the true TV that, unlike
    # PPO's single-sample ratio, lets rare tokens move (|p - q| <= delta instead of |r - 1| <= eps),
    # needs only the sampled token's log-prob (so it runs inside verl and TRL unchanged), and is
    # anchored to the rollout log-probs mu. Evidence (docs/results.md, embedded tasks, 3-6 seeds):
    # no divergence or estimator beat it beyond seed noise; top-K had a small AUC edge (+0.02,
    # not significant) but needs top-K log-probs that verl does not provide.
    "gppo": ("recommended: directional mask on binary TV > 0.15, anchored to mu",
             "this project (see docs/results.md)",
             dict(divergence="tv", estimator="binary", rule="mask", delta_low=0.15,
                  delta_high=0.15)),
}

PRESETS: MappingProxyType = MappingProxyType(
    {name: Preset(name, summary, source, MappingProxyType(values))
     for name, (summary, source, values) in _TABLE.items()}
)


def preset(name: str, **overrides) -> GPPOConfig:
    """The preset `name` as a validated GPPOConfig, with `overrides` applied field by field."""
    if name not in PRESETS:
        raise GPPOConfigError(
            f"unknown preset {name!r}{closest(name, PRESETS)}; choose one of {list(PRESETS)}"
        )
    valid = GPPOConfig.field_names()
    for key in overrides:
        if key not in valid:
            raise GPPOConfigError(
                f"unknown GPPOConfig field {key!r}{closest(key, valid)}; fields are {valid}"
            )
    return GPPOConfig(**{**PRESETS[name].fields, **overrides})
