"""`GPPOConfig`: one point of the design space, and its validation (the named points are
`gppo.core.presets`).

A point is a divergence, an estimator and a rule, each a name in its registry (DIVERGENCES,
ESTIMATORS, RULES); each entry declares the GPPOConfig fields it reads, its parameters. A parameter
is set only when the point uses it: left unset (None) it takes its default (for a divergence, the
divergence's own); given to a point that does not use it, it is an error that names the field, the
point and the fix. Every field's type is checked.
"""

from __future__ import annotations

import math
import numbers
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from gppo.core.batch import REQUIRED_FIELDS
from gppo.core.divergences import DIVERGENCES
from gppo.core.estimators import ANCHOR_FIELDS, ANCHOR_ROLES, ESTIMATORS
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
        """K of mu's top-K that the rollout must record (the topk and topp estimators, whose cells
        are mu's top-K or its nucleus within it), 0 when the estimator needs none."""
        if self.estimator is None or not ESTIMATORS.lookup(self.estimator).needs_rollout_topk:
            return 0
        return self.top_k

    @property
    def anchor_distribution(self) -> str | None:
        """The TokenBatch field holding the anchor's whole distribution [B,T,V] that the estimator
        reads (estimator 'full': logp_behavior_full, from the rollout, or logp_old_full, from the
        pi_old pass), else None. A caller that scores pi from hidden states reduces it to
        TokenBatch.full_estimate chunk by chunk (`gppo.token_stats(anchor_log_probs=...)`)."""
        if self.estimator is None or "full" not in ESTIMATORS.lookup(self.estimator).anchor:
            return None
        return ANCHOR_FIELDS[self.anchor][ANCHOR_ROLES.index("full")]

    @property
    def reference_distribution(self) -> str | None:
        """'logp_ref_full' when the KL penalty is exact (kl_estimator='full', kl_coef > 0): the
        reference's whole distribution, reduced to TokenBatch.kl_ref_full like the anchor's."""
        return "logp_ref_full" if self.kl_coef > 0 and self.kl_estimator == "full" else None

    def missing_fields(self, provided) -> list[str]:
        """The optional TokenBatch fields `policy_loss` reads with this config that are not among
        `provided` (names). A whole distribution counts as provided when its per-token reduction
        is (full_estimate for the anchor's, kl_ref_full for the reference's)."""
        provided, needed = set(provided) | set(REQUIRED_FIELDS), []
        if self.estimator is not None:
            est = ESTIMATORS.lookup(self.estimator)
            needed += [est.precomputed] if est.precomputed in provided else est.batch_fields(self.anchor)
        if self.anchor == "old":  # also what the behavior weight pi_old / mu reads
            needed.append("logp_old")
        if self.kl_coef > 0 and self.kl_estimator != "full":
            needed.append("logp_ref")
        elif self.kl_coef > 0:
            needed += ["kl_ref_full"] if "kl_ref_full" in provided else ["logits", "logp_ref_full"]
        return [name for name in dict.fromkeys(needed) if name not in provided]

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
