"""verl plugin: the GPPO presets as verl policy-loss modes (`pip install gppo[verl]`, verl 0.9).

Importing this module registers, with verl's `register_policy_loss`,
    gppo            the preset named by `policy_loss.preset` (default "gppo"), with per-field overrides;
    gppo_<preset>   every other preset, hyphens as underscores: gppo_ppo, gppo_dppo_binary_tv, ...
All of them call `gppo.policy_loss` unchanged. Their settings live in `GPPOPolicyLossConfig`
(`actor_rollout_ref.actor.policy_loss._target_`), validated when verl builds its ActorConfig at
start-up (in the driver's `validate_config`, then in every actor worker).

Version: verl >=0.9.1,<0.10 (the [verl] extra's pin); any other version is refused on import with
the install line (`check_verl_version`).

Loading: verl imports each `verl.plugins` entry point when `verl` is imported and only logs a
failure at debug level. Hydra imports this module again to instantiate `GPPOPolicyLossConfig`, and
that import is unguarded, so a broken install fails at start-up with its traceback.

What verl 0.9.1 hands a policy loss (`verl.workers.utils.losses.ppo_loss`): old_log_prob,
log_prob, advantages and response_mask [B,T], actor.loss_agg_mode, the ActorConfig (global batch
sizes in `global_batch_info`) and rollout_is_weights [B,T] or None; nothing else. Hence:
- the trust-region anchor is whatever verl put in old_log_prob: the rollout log-probs mu when
  algorithm.rollout_correction.bypass_mode=true (anchor='behavior', gppo's default), the
  recomputed pi_old otherwise (anchor='old'); the two must agree, checked at start-up;
- estimators that read more than the sampled token's log-probs (topk / topp / full, per the
  estimator registry) are refused at start-up (no top-K, no logits reach the loss), except topk /
  topp when the batch carries mu's top-K (policy_loss.topk_source=batch) and the actor's loss
  function is `topk_ppo_loss`, which gathers pi at those ids in the engine's logits processor:
  `python -m gppo.integrations.verl_topk` (verl's main_ppo with the rollout recording mu's top-K,
  gppo/integrations/verl_topk.py) sets both up, as does `python -m gppo.integrations.verl_async` for
  verl's fully-async trainer, or a caller that drives verl's TrainingWorker with its own rollouts;
- aggregation, KL to the reference and entropy stay verl's: actor.loss_agg_mode and
  loss_scale_factor, actor.use_kl_loss / kl_loss_coef, actor.entropy_coeff.
"""

from __future__ import annotations

import contextvars
import warnings
from dataclasses import dataclass, fields
from typing import Optional

import torch
import verl
from packaging.version import InvalidVersion, Version

import gppo

# The verl versions whose policy-loss interface this module is written against (pyproject's [verl]
# extra): verl.workers.utils.losses.ppo_loss's arguments, PolicyLossConfig's fields, the bypass-mode
# substitution and global_batch_info, all read from verl 0.9.1 and tested with it.
SUPPORTED_VERL = (Version("0.9.1"), Version("0.10"))


def check_verl_version(version: str) -> None:
    """Refuse a verl outside SUPPORTED_VERL, naming the version found and the install line."""
    low, high = SUPPORTED_VERL
    try:
        parsed = Version(Version(version).base_version)  # 0.10.0rc1 counts as 0.10.0
    except InvalidVersion:
        parsed = None
    if parsed is None or not low <= parsed < high:
        raise ImportError(
            f"gppo's verl plugin supports verl >={low},<{high} (tested with 0.9.1), found verl {version}: "
            f"the policy-loss interface it registers into differs in other versions. Run "
            f"pip install 'verl>={low},<{high}' (pip install 'gppo[verl]' pins it), or use a gppo "
            "release written for your verl"
        )


check_verl_version(verl.__version__)

from verl.trainer.ppo.core_algos import register_policy_loss  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402

DEFAULT_PRESET = "gppo"
# loss_mode -> preset; None: the preset is `policy_loss.preset`.
MODES = {"gppo": None, **{"gppo_" + name.replace("-", "_"): name for name in gppo.PRESETS if name != DEFAULT_PRESET}}

# verl's own PolicyLossConfig fields for its loss modes clip_cov, kl_cov and dro, which the gppo
# modes do not read: changed under a gppo mode, they are refused with the gppo field to set instead.
VERL_LOSS_FIELDS = {
    "clip_cov_ratio": "cov_ratio",
    "clip_cov_lb": "cov_low",
    "clip_cov_ub": "cov_high",
    "kl_cov_ratio": "cov_ratio",
    "ppo_kl_coef": "cov_kl_coef",
    "dro_beta": "kl_tau (= beta / 2)",
}
_VERL_DEFAULTS = {f.name: f.default for f in fields(PolicyLossConfig) if f.name in VERL_LOSS_FIELDS}

# The TokenBatch fields this plugin fills from what verl passes a policy loss.
PROVIDED_FIELDS = ("logp", "logp_behavior", "logp_old", "advantages", "mask")
# ... and those `topk_ppo_loss` adds when the batch carries mu's top-K (policy_loss.topk_source=batch).
TOPK_FIELDS = ("token_ids", "topk_ids", "topk_logp", "topk_logp_behavior")
TOPK_SOURCES = (None, "batch")
# mu's top-K travels in verl's batch under the keys of a teacher's top-K: [B, S, K] over the whole
# padded sequence, entry p holding the distribution that predicts token p + 1 (verl's layout for
# teacher_ids / teacher_logprobs, which left_right_2_no_padding turns into nested tensors and the
# engine's logits processor reads). Top-K distillation therefore cannot run in the same batch.
TOPK_IDS_KEY, TOPK_LOGPROBS_KEY = "teacher_ids", "teacher_logprobs"
_TOPK_OUTPUT = "gppo/topk_logp_{}"  # model_output keys: pi's log-prob at mu's k-th entry
_rollout_topk: contextvars.ContextVar = contextvars.ContextVar("gppo_rollout_topk", default=None)


@dataclass
class GPPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus the GPPO fields (null keeps the preset's value).

    `topk_source=batch` declares that each training batch carries mu's top-K (TOPK_IDS_KEY,
    TOPK_LOGPROBS_KEY) and that the actor's loss function is `topk_ppo_loss`: verl's own rollout
    records no top-K, so `python -m gppo.integrations.verl_topk` sets it (its rollout records
    them), or a caller that fills them driving verl's TrainingWorker with its own rollouts.
    `bypass_mode` and `use_v1` restate algorithm.rollout_correction.bypass_mode and trainer.use_v1
    (examples/verl/config/gppo_trainer.yaml interpolates them) so that the anchor can be checked
    here, at start-up.
    """

    preset: Optional[str] = None
    divergence: Optional[str] = None
    alpha: Optional[float] = None
    estimator: Optional[str] = None
    rule: Optional[str] = None
    delta_low: Optional[float] = None
    delta_high: Optional[float] = None
    anchor: Optional[str] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    truncation: Optional[float] = None
    dual_clip: Optional[float] = None
    clip_bounds: Optional[str] = None
    tau_pos: Optional[float] = None
    tau_neg: Optional[float] = None
    seq_reduce: Optional[str] = None
    kl_tau: Optional[float] = None
    cov_ratio: Optional[float] = None
    cov_low: Optional[float] = None
    cov_high: Optional[float] = None
    cov_kl_coef: Optional[float] = None
    k_pos: Optional[float] = None
    lambda_pos: Optional[float] = None
    k_neg: Optional[float] = None
    lambda_neg: Optional[float] = None
    off_policy_threshold: Optional[float] = None
    position_weight_min: Optional[float] = None
    prefix_budget: Optional[float] = None
    prefix_budget_mode: Optional[str] = None
    quadratic_delta: Optional[float] = None
    topk_source: Optional[str] = None
    bypass_mode: Optional[bool] = None
    use_v1: Optional[bool] = None

    def __post_init__(self):
        if self.loss_mode not in MODES:
            ignored = [name for name in ("preset", "topk_source", *OVERRIDABLE) if getattr(self, name) is not None]
            if ignored:
                raise gppo.GPPOConfigError(
                    f"policy_loss sets GPPO fields {ignored} but loss_mode={self.loss_mode!r} is not a "
                    f"gppo mode, so nothing would read them; use one of {sorted(MODES)}"
                )
            return
        changed = {
            name: getattr(self, name) for name in VERL_LOSS_FIELDS if getattr(self, name) != _VERL_DEFAULTS[name]
        }
        if changed:
            raise gppo.GPPOConfigError(
                f"policy_loss sets verl's {changed}, which loss_mode={self.loss_mode!r} does not read; "
                "set the gppo field instead: " + ", ".join(f"{name} -> {VERL_LOSS_FIELDS[name]}" for name in changed)
            )
        check_startup(self, self.gppo_config())

    @property
    def preset_name(self) -> str:
        fixed = MODES[self.loss_mode]
        if fixed is not None and self.preset not in (None, fixed):
            raise gppo.GPPOConfigError(
                f"policy_loss.loss_mode={self.loss_mode!r} fixes the preset {fixed!r} but "
                f"policy_loss.preset={self.preset!r}; use loss_mode=gppo to choose the preset by name"
            )
        return fixed or self.preset or DEFAULT_PRESET

    def gppo_config(self, loss_agg_mode: str = "token-mean", loss_scale_factor: int | None = None) -> gppo.GPPOConfig:
        """The preset with this config's overrides and verl's aggregation (actor.loss_agg_mode,
        actor.loss_scale_factor -> norm_length)."""
        if loss_agg_mode == "token-sum":
            raise gppo.GPPOConfigError(
                "actor.loss_agg_mode='token-sum' has no GPPO counterpart; use token-mean, "
                "seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm"
            )
        overrides = {name: getattr(self, name) for name in OVERRIDABLE if getattr(self, name) is not None}
        return gppo.preset(self.preset_name, loss_agg_mode=loss_agg_mode, norm_length=loss_scale_factor, **overrides)


# The GPPOConfig fields declared above, settable under policy_loss. verl owns aggregation and the KL
# penalty; the full estimator's fields and behavior_weight_cap need inputs verl does not pass to a
# policy loss (top_k / top_p serve the top-K estimators with topk_source=batch), so those are not declared.
OVERRIDABLE = tuple(f.name for f in fields(GPPOPolicyLossConfig) if f.name in gppo.GPPOConfig.field_names())


def check_startup(policy_loss: GPPOPolicyLossConfig, cfg: gppo.GPPOConfig) -> None:
    """Refuse what verl cannot feed: top-K/full estimators (top-K unless the batch carries it), a
    weight pi_old/mu (verl passes one anchor), and an anchor that old_log_prob is not."""
    mode = policy_loss.loss_mode
    if policy_loss.topk_source not in TOPK_SOURCES:
        raise gppo.GPPOConfigError(
            f"policy_loss.topk_source={policy_loss.topk_source!r}: use null (verl's rollout, which records "
            "no top-K) or 'batch' (your rollouts put mu's top-K in the batch, docs/verl.md)"
        )
    provided = provided_fields(policy_loss.topk_source)
    missing = cfg.missing_fields(provided)
    if missing:
        runnable = [name for name, entry in gppo.ESTIMATORS.items() if set(entry.batch_fields(cfg.anchor)) <= provided]
        if cfg.rollout_top_k and policy_loss.topk_source is None:
            raise gppo.GPPOConfigError(
                f"loss_mode={mode!r} uses estimator {cfg.estimator!r}, which needs mu's top-K token ids "
                "and log-probs at every response position; verl 0.9's rollout records only the sampled "
                "token's log-prob, and its ppo_loss passes a policy loss nothing more. Launch with "
                "`python -m gppo.integrations.verl_topk` instead of `python -m verl.trainer.main_ppo`, or "
                "`python -m gppo.integrations.verl_async` instead of verl's fully_async_main (same config "
                "and overrides: their vLLM rollout records mu's top-K and the actor reads it), "
                f"or use an estimator among {' / '.join(runnable)}, e.g. loss_mode=gppo_dppo_binary_tv "
                "instead of gppo_dppo_topk_tv (docs/verl.md)"
            )
        raise gppo.GPPOConfigError(
            f"loss_mode={mode!r} uses estimator {cfg.estimator!r} with anchor {cfg.anchor!r}, which needs "
            f"the TokenBatch fields {missing}; verl passes a policy loss only the sampled token's "
            f"log-probs{' and mu' + chr(39) + 's top-K' if policy_loss.topk_source else ''}. Use an "
            f"estimator among {' / '.join(runnable)}, e.g. loss_mode=gppo_dppo_binary_tv"
        )
    if cfg.behavior_weight_cap is not None:
        raise gppo.GPPOConfigError(
            f"loss_mode={mode!r} weights each token by sg[min(pi_old/mu, {cfg.behavior_weight_cap:g})] "
            "(behavior_weight_cap), but verl passes a policy loss one anchor, not both; verl applies that "
            "weight itself: use loss_mode=gppo_ppo with actor_rollout_ref.actor.policy_loss.anchor=old, "
            "algorithm.rollout_correction.bypass_mode=false, algorithm.rollout_correction.rollout_is=token "
            f"and rollout_is_threshold={cfg.behavior_weight_cap:g}"
        )
    if policy_loss.bypass_mode is None:
        raise gppo.GPPOConfigError(
            "policy_loss.bypass_mode is unset, so the plugin cannot tell whether verl's "
            "old_log_prob holds the rollout log-probs (mu) or the recomputed pi_old: set "
            "actor_rollout_ref.actor.policy_loss.bypass_mode='${algorithm.rollout_correction."
            "bypass_mode}' (examples/verl/config/gppo_trainer.yaml does)"
        )
    if cfg.anchor == "behavior" and not policy_loss.bypass_mode:
        raise gppo.GPPOConfigError(
            f"loss_mode={mode!r} anchors the trust region on the rollout log-probs (anchor='behavior') "
            "but algorithm.rollout_correction.bypass_mode=false makes verl pass the recomputed pi_old "
            "as old_log_prob. Set algorithm.rollout_correction.bypass_mode=true (with "
            "actor_rollout_ref.rollout.calculate_log_probs=true), or anchor on pi_old with "
            "actor_rollout_ref.actor.policy_loss.anchor=old"
        )
    if cfg.anchor == "old" and policy_loss.bypass_mode:
        raise gppo.GPPOConfigError(
            "policy_loss.anchor='old' asks for the recomputed pi_old but "
            "algorithm.rollout_correction.bypass_mode=true makes verl pass the rollout log-probs; "
            "set bypass_mode=false or anchor=behavior"
        )
    if policy_loss.bypass_mode and policy_loss.use_v1 is not True:
        raise gppo.GPPOConfigError(
            "bypass_mode=true needs trainer.use_v1=true (and policy_loss.use_v1='${trainer.use_v1}'): "
            "verl's legacy trainer rewrites policy_loss.loss_mode to 'bypass_mode' when bypass_mode "
            "is on (verl.trainer.ppo.rollout_corr_helper.apply_bypass_mode)"
        )


def provided_fields(topk_source: str | None = None) -> set[str]:
    """The TokenBatch fields the plugin fills (with topk_source='batch': and `topk_ppo_loss`)."""
    return set(PROVIDED_FIELDS + (TOPK_FIELDS if topk_source == "batch" else ()))


def global_normalizers(info: dict, loss_agg_mode: str) -> tuple[float | None, float | None]:
    """(num_tokens, num_sequences) for gppo.policy_loss from verl's global_batch_info.

    verl's agg_loss divides a micro-batch sum by batch_num_tokens / dp_size (token-mean) or by
    global_batch_size / dp_size (sequence modes), both counted over the global mini-batch.
    """
    token_mean = loss_agg_mode == "token-mean"
    key = "batch_num_tokens" if token_mean else "global_batch_size"
    dp_size = info.get("dp_size") or 1
    total = info.get(key)
    if total is None:
        if dp_size > 1:
            raise gppo.GPPOInputError(
                f"verl passed no global_batch_info[{key!r}] with dp_size={dp_size}: the loss of a "
                "data-parallel micro-batch needs the global count"
            )
        return None, None
    per_rank = total / dp_size
    return (per_rank, None) if token_mean else (None, per_rank)


def compute_policy_loss_gppo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl policy-loss function: TokenBatch from verl's arguments, then gppo.policy_loss.

    old_log_prob is the anchor (module docstring). rollout_is_weights w >= 0 scale the advantages:
    a rule whose per-token loss has l(w A) = w l(A) for w >= 0 (its branch depends on sign(A) only;
    `Rule.advantage_linear`) then gives verl's pg_losses * rollout_is_weights; the others are refused.
    """
    policy_loss = getattr(config, "policy_loss", None)
    if not isinstance(policy_loss, GPPOPolicyLossConfig):
        raise gppo.GPPOConfigError(
            "the gppo loss modes read their settings from "
            "actor_rollout_ref.actor.policy_loss._target_=gppo.integrations.verl.GPPOPolicyLossConfig; "
            f"got {type(policy_loss).__name__}"
        )
    cfg = policy_loss.gppo_config(loss_agg_mode, config.loss_scale_factor)
    preset_agg = gppo.preset(policy_loss.preset_name).loss_agg_mode
    if preset_agg != loss_agg_mode:
        warnings.warn(
            f"gppo preset {policy_loss.preset_name!r} is defined with loss_agg_mode="
            f"{preset_agg!r}; verl's actor.loss_agg_mode={loss_agg_mode!r} is used",
            stacklevel=2,
        )
    if rollout_is_weights is not None:
        if not gppo.RULES[cfg.rule].is_advantage_linear(cfg):
            raise gppo.GPPOConfigError(
                f"verl passed rollout_is_weights, which the plugin folds into the advantages, but the loss "
                f"of rule {cfg.rule!r} here is not proportional to A (a penalty or a selection by A): "
                "unset algorithm.rollout_correction.rollout_is, or use bypass_mode=true (anchor=behavior)"
            )
        advantages = advantages * rollout_is_weights
    # verl passes one anchor; both anchor fields hold it and cfg.anchor says which one it is
    # (checked against bypass_mode at start-up).
    topk = {}
    if cfg.rollout_top_k:
        topk = _rollout_topk.get()
        if topk is None:
            raise gppo.GPPOInputError(
                f"estimator {cfg.estimator!r} needs mu's top-K, which reaches the policy loss only "
                "through gppo.integrations.verl.topk_ppo_loss (the actor's loss function in place of "
                "verl's ppo_loss) with the batch carrying it: launch with `python -m "
                "gppo.integrations.verl_topk`, not verl's main_ppo, or `python -m gppo.integrations.verl_async`, "
                "not verl's fully_async_main (docs/verl.md)"
            )
        recorded = topk["topk_ids"].shape[-1]
        if cfg.top_k is not None and recorded < cfg.top_k:
            raise gppo.GPPOInputError(
                f"the batch carries mu's top-{recorded} but top_k={cfg.top_k}: record at least "
                f"{cfg.top_k} log-probs per token in the rollout, or set policy_loss.top_k={recorded}"
            )
    batch = gppo.TokenBatch(
        logp=log_prob,
        logp_behavior=old_log_prob,
        logp_old=old_log_prob,
        advantages=advantages,
        mask=response_mask,
        **topk,
    )
    num_tokens, num_sequences = global_normalizers(config.global_batch_info, loss_agg_mode)
    loss, metrics = gppo.policy_loss(batch, cfg, num_tokens=num_tokens, num_sequences=num_sequences)
    # verl logs the loss itself (actor/pg_loss, summed over micro-batches); the rest are means.
    # verl's Metric.aggregate_dp needs every key in every micro-batch of every rank, so the masked
    # fractions of sub-groups (masked_frac/adv_pos, /adv_neg, /q[...]), which gppo leaves out
    # where the micro-batch has no token of the group, are not reported.
    return loss, {
        f"gppo/{name}": value
        for name, value in metrics.items()
        if name != "loss/policy" and not name.startswith("masked_frac/")
    }


def topk_ppo_loss(config, model_output=None, data=None, dp_group=None, student_logits=None):
    """The actor's loss function for the top-K / nucleus estimators, in place of verl's ppo_loss
    (`TrainingWorker.set_loss_fn(functools.partial(topk_ppo_loss, config=actor_config))`).

    verl's FSDP engine calls the loss function twice per micro-batch when the batch's non-tensor
    `distillation_use_topk` is true (the hook of its top-K distillation):
    - with `student_logits` [1, N, V] (all N packed tokens, temperature applied): returns, per
      recorded entry k, pi's log-prob at mu's k-th token id as a [1, N] tensor (the hook takes
      per-token values only): log_softmax(logits)[id], by gppo.logits_stats, one chunk of tokens
      at a time;
    - with `model_output`: lays those out as [B, T, K], takes mu's top-K ids and log-probs from the
      batch (TOPK_IDS_KEY, TOPK_LOGPROBS_KEY) and the sampled ids (`responses`), and runs verl's
      own ppo_loss, whose gppo policy loss reads them (entropy, KL and aggregation stay verl's).
    """
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    if student_logits is not None:
        ids = data[TOPK_IDS_KEY].values().unsqueeze(0).long()  # [1, N, K]
        if get_ulysses_sequence_parallel_world_size() > 1:  # the engine's logits are this rank's slice
            ids = slice_input_tensor(ids, dim=1)
        if ids.shape[:2] != student_logits.shape[:2]:
            raise gppo.GPPOInputError(
                f"batch[{TOPK_IDS_KEY!r}] has {ids.shape[1]} packed positions but the logits "
                f"{student_logits.shape[1]}: mu's top-K must be [B, S, K] over the padded prompt + "
                "response, like input_ids"
            )
        picked = gppo.logits_stats(student_logits[0], topk_ids=ids[0]).topk_logp[None]
        return {_TOPK_OUTPUT.format(k): picked[..., k] for k in range(ids.shape[-1])}
    if model_output is None or _TOPK_OUTPUT.format(0) not in model_output:
        raise gppo.GPPOInputError(
            "topk_ppo_loss got no top-K log-probs from the engine: set the batch's non-tensor "
            "distillation_use_topk=True (verl's engine then calls the loss function as its logits "
            f"processor) and put mu's top-K in batch[{TOPK_IDS_KEY!r}] / batch[{TOPK_LOGPROBS_KEY!r}]; "
            "`python -m gppo.integrations.verl_topk` does both"
        )
    recorded = data[TOPK_IDS_KEY].values().shape[-1]
    responses = data["responses"]
    topk = {
        "token_ids": responses.to_padded_tensor(0) if responses.is_nested else responses,
        "topk_ids": no_padding_2_padding(data[TOPK_IDS_KEY], data).long(),
        "topk_logp_behavior": no_padding_2_padding(data[TOPK_LOGPROBS_KEY], data).float(),
        "topk_logp": torch.stack(
            [no_padding_2_padding(model_output[_TOPK_OUTPUT.format(k)], data) for k in range(recorded)], -1
        ),
    }
    token = _rollout_topk.set(topk)
    try:
        return ppo_loss(config, model_output, data, dp_group)
    finally:
        _rollout_topk.reset(token)


for _mode in MODES:
    register_policy_loss(_mode)(compute_policy_loss_gppo)
