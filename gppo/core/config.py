"""`GPPOConfig` (one point of the design space) and `PRESETS` (the named methods, as data).

A point is a divergence, an estimator and a rule, each a name in its registry (DIVERGENCES,
ESTIMATORS, RULES); each entry declares the GPPOConfig fields it reads, its parameters. A parameter
is set only when the point uses it: left unset (None) it takes its default (for a divergence, the
divergence's own); given to a point that does not use it, it is an error that names the field, the
point and the fix. Every field's type is checked. A preset is a point plus defaults (docs/design.md
section 5), listed in the single table `PRESETS`; `preset(name, **overrides)` builds a validated
`GPPOConfig` from it, dropping preset parameters that an overridden point no longer uses.

Over 500 lines on purpose: the preset table is data (one entry per named method, with its
source and the reading it takes), kept beside the validation that builds each entry.
"""

from __future__ import annotations

import math
import numbers
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType

from gppo.core.divergences import DIVERGENCES
from gppo.core.estimators import ESTIMATORS
from gppo.core.params import PARAM_DEFAULTS, PARAM_FIELDS, PARAMS
from gppo.core.registry import closest
from gppo.core.rules import RULES


class GPPOConfigError(ValueError):
    """An invalid point of the design space; the message names the field and the fix."""


ANCHORS = ("behavior", "old")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "full")
BEHAVIOR_WEIGHT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's names
CLIP_BOUNDS = ("region", "dcpo")
SEQ_REDUCES = ("max", "mean")
PREFIX_BUDGET_MODES = ("fixed", "p90")


def _users(name: str) -> list[str]:
    """The registry entries that declare `name` as a parameter, e.g. ['rule soft']."""
    out = []
    for axis, registry in (("divergence", DIVERGENCES), ("estimator", ESTIMATORS), ("rule", RULES)):
        users = [n for n, entry in registry.items() if name in entry.params]
        if users:
            out.append(f"{axis}{'s' if len(users) > 1 else ''} {', '.join(users)}")
    return out


class _Metadata(Mapping):
    """Field metadata whose 'help' is composed when read, from the registries as they are then
    (so `gppo train --help` lists names registered after import, plugins included)."""

    def __init__(self, help_fn, **static):
        self._help, self._static = help_fn, static

    def __getitem__(self, key):
        return self._help() if key == "help" else self._static[key]

    def __iter__(self):
        return iter(("help", *self._static))

    def __len__(self):
        return 1 + len(self._static)

    def copy(self) -> dict:
        return dict(self)


def _doc(text, **kw):
    """A field with its help text (a string, or a function giving it)."""
    return field(metadata=_Metadata(text if callable(text) else lambda: text), **kw)


def _param(name: str):
    """A point parameter (`params.PARAMS`): None until the point uses it, then its default unless given."""

    def help_text():
        default = PARAMS[name].default
        shown = "" if default is None else f"; default {default}"
        return (
            f"{PARAMS[name].help} (parameter of {'; '.join(_users(name)) or 'no registered entry'}"
            f"{shown}; an error for other points)"
        )

    return field(default=None, metadata=_Metadata(help_text, param=True))


def _names(registry) -> str:
    return ", ".join(registry)


@dataclass
class GPPOConfig:
    """One point of the GPPO design space. Build it with `gppo.preset(name, **overrides)`."""

    divergence: str | None = _doc(
        lambda: f"f-divergence of the trust region: {_names(DIVERGENCES)} (None for rules that use no estimate)",
        default="tv",
    )
    alpha: float | None = _param("alpha")
    estimator: str | None = _doc(
        lambda: f"how D_f is estimated per token: {_names(ESTIMATORS)} (None for rules that use no estimate)",
        default="sample",
    )
    rule: str = _doc(lambda: f"trust-region rule: {_names(RULES)}", default="clip")
    delta_low: float | None = _param("delta_low")
    delta_high: float | None = _param("delta_high")
    anchor: str = _doc(
        "trust-region centre: 'behavior' (rollout log-probs mu) or 'old' (recomputed pi_old)", default="behavior"
    )
    loss_agg_mode: str = _doc("aggregation: " + ", ".join(LOSS_AGG_MODES), default="token-mean")
    norm_length: int | None = _doc("constant length L of seq-mean-token-sum-norm (None: the batch's T)", default=None)
    top_k: int | None = _param("top_k")
    top_p: float | None = _param("top_p")
    truncation: float | None = _param("truncation")
    dual_clip: float | None = _param("dual_clip")
    clip_bounds: str | None = _param("clip_bounds")
    tau_pos: float | None = _param("tau_pos")
    tau_neg: float | None = _param("tau_neg")
    seq_reduce: str | None = _param("seq_reduce")
    kl_tau: float | None = _param("kl_tau")
    cov_ratio: float | None = _param("cov_ratio")
    cov_low: float | None = _param("cov_low")
    cov_high: float | None = _param("cov_high")
    cov_kl_coef: float | None = _param("cov_kl_coef")
    k_pos: float | None = _param("k_pos")
    lambda_pos: float | None = _param("lambda_pos")
    k_neg: float | None = _param("k_neg")
    lambda_neg: float | None = _param("lambda_neg")
    off_policy_threshold: float | None = _param("off_policy_threshold")
    position_weight_min: float | None = _param("position_weight_min")
    prefix_budget: float | None = _param("prefix_budget")
    prefix_budget_mode: str | None = _param("prefix_budget_mode")
    quadratic_delta: float | None = _param("quadratic_delta")
    kl_coef: float = _doc("coefficient beta of the KL penalty to the reference model", default=0.0)
    kl_estimator: str = _doc("KL penalty estimator: k1, k2, k3 or full (exact, needs logits)", default="k3")
    behavior_weight_cap: float | None = _doc(
        "anchor='old' only: multiply each token's loss by sg[min(pi_old/mu, cap)] to correct the "
        "rollout/training mismatch (truncated IS); None disables",
        default=None,
    )
    behavior_weight_floor: float | None = _doc(
        "anchor='old' only: lower end of the behavior weight's band (TRL's "
        "vllm_importance_sampling_clip_min); None: no lower end",
        default=None,
    )
    behavior_weight_mode: str = _doc(
        "how the weight pi_old/mu meets the band [floor, cap] (TRL's vllm_importance_sampling_mode): "
        + ", ".join(BEHAVIOR_WEIGHT_MODES)
        + "; sequence_* use the sequence's product of token "
        "ratios, *_mask weight 0 outside the band",
        default="token_truncate",
    )
    full_chunk_size: int = _doc(
        "tokens per chunk of estimator 'full' and of the entropy metric "
        "(memory: one chunk of [chunk, V] beyond the logits)",
        default=512,
    )

    def __post_init__(self):
        _validate(self)

    @property
    def divergence_fn(self):
        """The `Divergence` object (None for rules that use none)."""
        if self.divergence is None:
            return None
        cls = DIVERGENCES.lookup(self.divergence)
        given = {name: getattr(self, name) for name in cls.params}
        return cls(**{name: value for name, value in given.items() if value is not None})

    @property
    def uses_estimate(self) -> bool:
        return RULES.lookup(self.rule).needs_estimate(self)

    @property
    def rollout_top_k(self) -> int:
        """K of mu's top-K that the rollout must record (0 when the estimator needs none)."""
        if self.estimator is None or not ESTIMATORS.lookup(self.estimator).needs_rollout_topk:
            return 0
        return self.top_k

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_HINTS = typing.get_type_hints(GPPOConfig)


def _check_type(name: str, value):
    """The value converted to the field's type (int -> float where a float is expected), or an error."""
    hint = _HINTS[name]
    optional = type(None) in typing.get_args(hint)
    base = next(h for h in (typing.get_args(hint) or (hint,)) if h is not type(None))
    if value is None:
        if optional:
            return None
    elif base is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    elif base is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    elif base is str and isinstance(value, str):
        return value
    expected = {float: "a number", int: "an integer", str: "a string"}[base]
    fix = ""
    if isinstance(value, str) and base is not str:
        try:
            fix = f"; pass the number {name}={base(value)!r}, not the string {value!r}"
        except ValueError:
            pass
    raise GPPOConfigError(
        f"GPPOConfig.{name} must be {expected}{' or None' if optional else ''}, got "
        f"{type(value).__name__} {value!r}{fix}"
    )


def _choice(cfg, name, choices):
    value = getattr(cfg, name)
    if value not in choices:
        raise GPPOConfigError(
            f"GPPOConfig.{name}={value!r} is not valid{closest(value, choices)}; choose one of {list(choices)}"
        )


def _lookup(registry, cfg, name):
    try:
        return registry.lookup(getattr(cfg, name))
    except ValueError as err:
        raise GPPOConfigError(f"GPPOConfig.{name}: {err}") from None


def _point(cfg) -> str:
    if cfg.divergence is None and cfg.estimator is None:
        return f"rule {cfg.rule!r}"
    return f"{cfg.divergence} x {cfg.estimator} x {cfg.rule}"


# Value checks of the fields that are set: (test, what it must be).
_CHECKS = {
    "delta_low": (lambda v: v > 0, "> 0"),
    "delta_high": (lambda v: v > 0, "> 0"),
    "top_k": (lambda v: v >= 1, ">= 1"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "truncation": (lambda v: v > 0, "> 0 or None"),
    "dual_clip": (lambda v: v > 1, "> 1"),
    "tau_pos": (lambda v: v > 0, "> 0"),
    "tau_neg": (lambda v: v > 0, "> 0"),
    "kl_tau": (lambda v: 0 < v < math.inf, "> 0 and finite, or None to disable the penalty"),
    "cov_ratio": (lambda v: 0 < v <= 1, "in (0, 1]: the fraction of tokens selected"),
    "off_policy_threshold": (lambda v: 0 <= v < math.inf, ">= 0 and finite, or None to disable the mask"),
    "cov_low": (lambda v: not math.isnan(v), "a number (-inf: no lower end)"),
    "cov_high": (lambda v: not math.isnan(v), "a number (inf: no upper end)"),
    "cov_kl_coef": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "k_pos": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "k_neg": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "lambda_pos": (lambda v: 0 < v < math.inf, "> 0 and finite (lambda = 0 would leave w^k unbounded)"),
    "lambda_neg": (lambda v: 0 < v < math.inf, "> 0 and finite (lambda = 0 would leave w^k unbounded)"),
    "position_weight_min": (lambda v: 0 < v <= 1, "in (0, 1]: the last token's weight (1: no position weight)"),
    "prefix_budget": (lambda v: 0 < v < math.inf, "> 0 and finite"),
    "quadratic_delta": (lambda v: 0 < v < math.inf, "> 0 and finite"),
    "kl_coef": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "behavior_weight_cap": (lambda v: v > 0, "> 0"),
    "behavior_weight_floor": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "norm_length": (lambda v: v >= 1, ">= 1"),
    "full_chunk_size": (lambda v: v >= 1, ">= 1"),
}  # comparisons are False for NaN, so NaN is refused everywhere


def _check_behavior_weight(cfg: GPPOConfig) -> None:
    cap, floor = cfg.behavior_weight_cap, cfg.behavior_weight_floor
    if cap is None and floor is None:
        if cfg.behavior_weight_mode != "token_truncate":
            raise GPPOConfigError(
                f"GPPOConfig.behavior_weight_mode={cfg.behavior_weight_mode!r} has no band to apply: set "
                "behavior_weight_cap and/or behavior_weight_floor (TRL's vllm_importance_sampling_clip_max "
                "/ _min), or leave the mode at 'token_truncate'"
            )
        return
    if cfg.anchor != "old":
        name = "behavior_weight_cap" if cap is not None else "behavior_weight_floor"
        raise GPPOConfigError(
            f"GPPOConfig.{name} corrects pi_old vs mu and needs anchor='old'; with "
            "anchor='behavior' the ratio already uses mu (use truncation to cap it)"
        )
    if floor is not None and cap is not None and not floor <= cap:
        raise GPPOConfigError(
            f"GPPOConfig.behavior_weight_floor={floor} must be <= behavior_weight_cap={cap}: the band "
            "[floor, cap] would be empty; lower the floor or raise the cap"
        )


def _validate(cfg: GPPOConfig) -> None:
    for f in fields(cfg):
        setattr(cfg, f.name, _check_type(f.name, getattr(cfg, f.name)))
    _choice(cfg, "anchor", ANCHORS)
    _choice(cfg, "loss_agg_mode", LOSS_AGG_MODES)
    _choice(cfg, "kl_estimator", KL_ESTIMATORS)
    _choice(cfg, "behavior_weight_mode", BEHAVIOR_WEIGHT_MODES)
    for name, choices in (
        ("clip_bounds", CLIP_BOUNDS),
        ("seq_reduce", SEQ_REDUCES),
        ("prefix_budget_mode", PREFIX_BUDGET_MODES),
    ):
        if getattr(cfg, name) is not None:
            _choice(cfg, name, choices)

    rule = _lookup(RULES, cfg, "rule")
    used = set(rule.params)
    _set_defaults(cfg, rule.params)  # the rule's parameters may decide whether it uses an estimate
    if rule.needs_estimate(cfg):
        if cfg.divergence is None or cfg.estimator is None:
            raise GPPOConfigError(
                f"rule {cfg.rule!r} needs a divergence and an estimator (got divergence="
                f"{cfg.divergence!r}, estimator={cfg.estimator!r})"
            )
        est = _lookup(ESTIMATORS, cfg, "estimator")
        div = _lookup(DIVERGENCES, cfg, "divergence")
        allowed = rule.estimators
        if allowed is None and rule.ratio_interval:
            allowed = tuple(n for n, e in ESTIMATORS.items() if e.has_ratio_interval)
        if allowed is not None and est.name not in allowed:
            raise GPPOConfigError(
                f"rule {cfg.rule!r} clips the sampled token's ratio, so it needs an estimator "
                f"whose trust region is a ratio interval ({', '.join(allowed)}); estimator "
                f"{cfg.estimator!r} is not one. Use rule='mask', which has the same gradient as "
                "clipping, or one of those estimators"
            )
        used |= set(est.params) | set(div.params)
    elif cfg.divergence is not None or cfg.estimator is not None:
        what = "DCPO bounds" if cfg.rule == "clip" else f"rule {cfg.rule!r}"
        raise GPPOConfigError(
            f"{what} uses no divergence estimate: set divergence=None and estimator=None "
            f"(got divergence={cfg.divergence!r}, estimator={cfg.estimator!r})"
        )
    for name in PARAM_FIELDS:
        value = getattr(cfg, name)
        if value is not None and name not in used:
            users = _users(name)
            raise GPPOConfigError(
                f"GPPOConfig.{name}={value!r} is not used by the point {_point(cfg)}: {name} is a "
                f"parameter of {' and '.join(users) or 'no registered entry'}. Remove {name}, or "
                "choose a point that uses it"
            )
    _set_defaults(cfg, used)
    for name, (test, must) in _CHECKS.items():
        value = getattr(cfg, name)
        if value is not None and not test(value):
            raise GPPOConfigError(f"GPPOConfig.{name} must be {must} (got {value})")
    if cfg.cov_low is not None and not cfg.cov_low < cfg.cov_high:
        raise GPPOConfigError(
            f"GPPOConfig.cov_low={cfg.cov_low} must be below cov_high={cfg.cov_high}: no covariance "
            "would lie in (cov_low, cov_high), so no token could be selected; lower cov_low or raise "
            "cov_high"
        )
    if cfg.uses_estimate:
        try:
            built = cfg.divergence_fn
        except ValueError as err:
            raise GPPOConfigError(f"GPPOConfig.divergence: {err}") from None
        for name in built.params:  # unset divergence parameters take the divergence's defaults
            setattr(cfg, name, getattr(built, name))
    _check_behavior_weight(cfg)


def _set_defaults(cfg: GPPOConfig, names) -> None:
    """Unset parameters among `names` take their field's default (None for a divergence's: the
    divergence applies its own)."""
    for name in names:
        if getattr(cfg, name) is None:
            setattr(cfg, name, PARAM_DEFAULTS[name])


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
