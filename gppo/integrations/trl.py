"""TRL integration: `GPPOTrainer`, TRL's GRPOTrainer with the GPPO objective (`pip install gppo[trl]`).

Generation, rewards, advantages, the reference model and logging stay TRL's; only the loss changes:
`_compute_loss` (TRL's one extension point for the loss) builds a `gppo.TokenBatch` and calls
`gppo.policy_loss` unchanged. Written against TRL 1.16.

Which log-probs play which role (all at TRL's sampling temperature):
- pi_old (logp_old): TRL's old-policy pass `old_per_token_logps` when TRL runs it (num_iterations > 1,
  generation misaligned with optimizer steps, or vLLM), else the current log-probs detached (the
  policy has not moved since generation);
- mu (logp_behavior): vLLM's `sampling_per_token_logps` when vLLM generates (tokens vLLM could not
  score fall back to pi_old, as in TRL), else pi_old, which is the sampling policy itself when
  transformers' `generate` samples with the training weights;
- top-K (estimators whose registry entry needs rollout top-K: topk, topp): TRL records no top-K, so
  right after generation this trainer runs one extra no-grad forward of the model that generated
  (the old-policy pass it controls) and keeps that distribution's top-K ids and log-probs; the
  training forward then computes the current policy's log-probs at those ids. Both passes run the
  model's own forward with the output layer's forward replaced by `gppo.token_stats` on the last
  hidden states of the completion tokens, one chunk of tokens at a time: no [B,T,V] logits, and
  DDP / FSDP / DeepSpeed see an ordinary forward of the model they wrap. With transformers'
  `generate` that distribution is mu. With vLLM it is pi_old (TRL asks vLLM for the sampled
  token's log-prob only), so top-K needs anchor='old' there; anchor='behavior' is refused.
Aggregation normalisers reproduce TRL's: token-mean divides by the accumulation window's token count
(TRL's "dapo" normaliser), the sequence modes by its sequence count, and seq-mean-token-sum-norm's
length defaults to max_completion_length (TRL's "dr_grpo").
Tool tokens (TRL's `tools` / `environment_factory` results, a rollout_func's `env_mask`: TRL's
`tool_mask` = 0) are context for every forward and never a term: the loss mask is completion_mask *
tool_mask, and the top-K passes skip them (0 there).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

import gppo
from gppo.models.forward import decoder_and_output_layer
from gppo.options import ConfigError, Source, gppo_overrides

# TokenBatch fields GPPOTrainer fills: the sampled token's log-probs (both anchors) and ids, the
# top-K of its own old-policy pass when the estimator needs rollout top-K, the reference's log-probs.
PROVIDED_FIELDS = (
    "logp",
    "logp_behavior",
    "logp_old",
    "advantages",
    "mask",
    "token_ids",
    "topk_ids",
    "topk_logp",
    "topk_logp_behavior",
    "topk_logp_old",
    "logp_ref",
)
# Inputs of TRL's log-prob pass for vision-language models, passed through unchanged.
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# GRPOConfig fields that only TRL's own loss reads: gppo_preset / gppo_overrides replace them.
TRL_LOSS_FIELDS = (
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "off_policy_mask_threshold",
)
# GRPOConfig features implemented inside TRL's loss that GPPOTrainer does not apply.
TRL_LOSS_FEATURES = ("top_entropy_quantile", "entropy_coef", "use_adaptive_entropy")


@dataclass
class GPPOTrainerConfig(GRPOConfig):
    """TRL's GRPOConfig plus the GPPO point: `gppo_preset` and `gppo_overrides`.

    The KL penalty to the reference model is TRL's `beta` (gppo's kl_coef; estimator k3 by default,
    as in TRL, without TRL's importance weight: use_bias_correction_kl=False is required when
    beta != 0). TRL's own loss settings (loss_type, epsilon, ...) are refused when changed.
    """

    gppo_preset: str = field(default="gppo", metadata={"help": "GPPO preset: " + ", ".join(gppo.PRESETS)})
    gppo_overrides: dict | str | None = field(
        default=None,
        metadata={
            "help": "GPPOConfig fields that override the preset, e.g. "
            '{"divergence": "hellinger", "delta_high": 0.2} (JSON on the command line)'
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.gppo_overrides = parse_overrides(self.gppo_overrides)
        defaults = {f.name: f.default for f in fields(GRPOConfig)}
        changed = [name for name in TRL_LOSS_FIELDS if getattr(self, name) != defaults[name]]
        if changed:
            raise gppo.GPPOConfigError(
                f"GPPOTrainer replaces TRL's loss, so {changed} would be ignored: choose the loss with "
                "gppo_preset and gppo_overrides (docs/trl.md maps TRL's loss types to presets)"
            )
        changed = [name for name in TRL_LOSS_FEATURES if getattr(self, name) != defaults[name]]
        if changed:
            raise gppo.GPPOConfigError(f"GPPOTrainer does not apply TRL's {changed}; leave them at their defaults")
        if self.beta != 0 and self.use_bias_correction_kl:
            raise gppo.GPPOConfigError(
                "GPPOTrainer adds gppo's KL penalty beta * k3 without TRL's importance weight pi/pi_old "
                "(use_bias_correction_kl, on by default in TRL); set use_bias_correction_kl=False"
            )
        self.gppo_config()

    def gppo_config(self) -> gppo.GPPOConfig:
        """The preset with `gppo_overrides`, kl_coef = beta and norm_length = max_completion_length."""
        return resolve_gppo_config(
            self.gppo_preset,
            self.gppo_overrides,
            self.max_completion_length,
            PROVIDED_FIELDS,
            kl_coef=self.beta,
            kl_hint="set the KL coefficient with TRL's beta, not gppo_overrides['kl_coef']: TRL computes "
            "the reference log-probs only when beta != 0",
            trainer="GPPOTrainer",
            hint="the old policy's full distribution [B,T,V] would have to be kept for the whole generation "
            "batch; use topk",
        )


def resolve_gppo_config(
    preset: str, overrides: dict | None, max_completion_length: int, provided, *, kl_coef: float, kl_hint: str,
    trainer: str, hint: str,
) -> gppo.GPPOConfig:  # fmt: skip
    """The preset with `overrides`, `kl_coef` and norm_length = max_completion_length, refused when its
    loss reads a TokenBatch field outside `provided` (the fields `trainer` fills)."""
    overrides = dict(overrides or {})
    if "kl_coef" in overrides:
        raise gppo.GPPOConfigError(kl_hint)
    overrides.setdefault("norm_length", max_completion_length)
    cfg = gppo.preset(preset, kl_coef=kl_coef, **overrides)
    missing = cfg.missing_fields(provided)
    if missing or cfg.kl_estimator == "full":
        what = f"estimator={cfg.estimator!r} (it reads {missing})" if missing else "kl_estimator='full'"
        raise gppo.GPPOConfigError(f"{trainer} cannot run {what}: {hint}")
    return cfg


def parse_overrides(overrides: dict | str | None) -> dict:
    """`gppo_overrides` (a mapping, or JSON text from the command line) with every value converted
    to its GPPOConfig field's type by the validation `gppo train` uses (gppo.options)."""
    source = Source("mapping", "gppo_overrides")
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides) if overrides.strip() else {}
        except json.JSONDecodeError as err:
            raise gppo.GPPOConfigError(
                f"gppo_overrides: {overrides!r} is not JSON ({err.msg} at column {err.colno}); give e.g. "
                '\'{"divergence": "kl", "delta_high": 0.2}\' (double quotes around names)'
            ) from None
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise gppo.GPPOConfigError(
            f'gppo_overrides: {overrides!r} is not a mapping of GPPOConfig fields; give e.g. {{"divergence": "kl"}}'
        )
    try:
        return gppo_overrides(overrides, source)
    except ConfigError as err:
        raise gppo.GPPOConfigError(str(err)) from None


def loss_mask(inputs) -> torch.Tensor:
    """completion_mask * tool_mask [B,T]: TRL's tool_mask is 0 at the tokens a tool or environment
    wrote into the completion (context for the forward, no term of the loss), absent without tools."""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


@contextmanager
def replaced_forward(module: torch.nn.Module, forward):
    """`module(...)` calls `forward` instead of the module's own forward (its hooks still run: FSDP
    and DeepSpeed ZeRO-3 gather its parameters around the call and for its backward)."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class GPPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with the GPPO loss. Takes GRPOTrainer's arguments, with
    `args=GPPOTrainerConfig(...)`; metrics are logged as gppo/<name>."""

    _tag_names = ["trl", "gppo"]

    def __init__(self, model, reward_funcs=None, args: GPPOTrainerConfig | None = None, **kwargs):
        if not isinstance(args, GPPOTrainerConfig):
            raise TypeError(f"GPPOTrainer needs args=GPPOTrainerConfig(...), got {type(args).__name__}")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self.gppo = args.gppo_config()
        if self.aux_loss_enabled:
            raise gppo.GPPOConfigError(
                "GPPOTrainer does not add the MoE router auxiliary loss; set router_aux_loss_coef=0"
            )
        if self.use_vllm and self.gppo.rollout_top_k and self.gppo.anchor == "behavior":
            raise gppo.GPPOConfigError(
                f"estimator {self.gppo.estimator!r} with anchor='behavior' needs vLLM's top-K log-probs, "
                "which GRPOTrainer does not request; use gppo_overrides={'anchor': 'old'} (top-K of the "
                "old-policy pass) or a binary estimator"
            )

    def _output_layer_pass(self, model, inputs, rows: slice, compute) -> torch.Tensor:
        """Run `model`'s own forward (the wrapped one under DDP / FSDP / DeepSpeed, so that gradient
        sync and parameter gathering happen as usual) on the prompt + completion `rows`, with the
        output layer's forward replaced for this call by compute(hidden [B,T,H], weight, bias) ->
        [B,T,C]: it receives the last hidden states that predict the completion tokens and the
        output layer's (gathered) parameters, in autocast's dtype when the forward autocasts (TRL's
        bf16 / fp16: the logits' precision of TRL's own passes), and its result comes back as the
        model's `logits`. No [B,T,V] logits are made (text-only models)."""
        if any(inputs.get(key) is not None for key in VISION_KEYS):
            raise gppo.GPPOConfigError("top-K estimators in GPPOTrainer support text-only models")
        _, head = decoder_and_output_layer(self.accelerator.unwrap_model(model))
        completion_ids = inputs["completion_ids"][rows]
        input_ids = torch.cat([inputs["prompt_ids"][rows], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], dim=1)

        def forward(hidden):  # logits_to_keep = T + 1: the last position predicts past the completion
            weight, bias = head.weight, head.bias
            device = hidden.device.type
            if torch.is_autocast_enabled(device):  # the output layer in the precision autocast runs it
                dtype = torch.get_autocast_dtype(device)
                weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
            return compute(hidden[:, :-1], weight, bias)

        with replaced_forward(head, forward), self.accelerator.autocast():
            return model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=completion_ids.size(1) + 1,
                use_cache=False,
            ).logits

    def _policy_topk(self, model, inputs):
        """(logp [B,T], topk_logp [B,T,K] at inputs["gppo_topk_ids"], entropy [B,T] detached) of the
        policy at the completion's model tokens (0 at padding and tool tokens), by gppo.token_stats
        from the last hidden states, one chunk of tokens at a time (its backward recomputes each
        chunk's logits)."""
        valid = loss_mask(inputs).bool()
        topk_ids = inputs["gppo_topk_ids"]
        top_k = topk_ids.size(-1)

        def compute(hidden, weight, bias):
            stats = gppo.token_stats(
                hidden[valid],
                weight,
                inputs["completion_ids"][valid],
                bias=bias,
                temperature=self.temperature,
                topk_ids=topk_ids[valid],
                entropy=True,
            )
            values = torch.cat([stats.logp[:, None], stats.topk_logp, stats.entropy.detach()[:, None]], 1)
            return values.new_zeros((*valid.shape, top_k + 2)).index_put((valid,), values)

        values = self._output_layer_pass(model, inputs, slice(None), compute)
        return values[..., 0], values[..., 1:-1], values[..., -1]

    def _sampling_topk(self, output, rows: slice):
        """(topk_ids [B,T,K], topk_logp [B,T,K], logp [B,T]) of the generating weights at the
        completion `rows` of a generation batch (0 at padding and tool tokens, whose top-K is never
        read), without gradient: the top-K of log_softmax(logits / temperature) by gppo.token_stats,
        one chunk of tokens at a time (the numerics of the training pass, at most a chunk of [tokens, V])."""
        valid = loss_mask(output)[rows].bool()
        completion_ids = output["completion_ids"][rows][valid]
        top_k = self.gppo.rollout_top_k
        found = {}

        def compute(hidden, weight, bias):
            stats = gppo.token_stats(hidden[valid], weight, completion_ids, bias=bias, temperature=self.temperature,
                                     top_k=top_k)  # fmt: skip
            found["ids"] = stats.pi_topk_ids.new_zeros((*valid.shape, top_k)).index_put((valid,), stats.pi_topk_ids)
            values = torch.cat([stats.logp[:, None], stats.pi_topk_logp], 1)
            return values.new_zeros((*valid.shape, top_k + 1)).index_put((valid,), values)

        values = self._output_layer_pass(self.model, output, rows, compute)
        return found["ids"], values[..., 1:], values[..., 0]

    def _generate_and_score_completions(self, inputs):
        """TRL's generation batch, plus the generating policy's top-K for estimators topk / topp."""
        output = super()._generate_and_score_completions(inputs)
        if not self.gppo.rollout_top_k:
            return output
        ids, topk_logp, token_logp = [], [], []
        chunk = self.args.per_device_train_batch_size
        with torch.no_grad():
            for start in range(0, output["completion_ids"].size(0), chunk):
                for values, parts in zip(
                    self._sampling_topk(output, slice(start, start + chunk)), (ids, topk_logp, token_logp), strict=True
                ):
                    parts.append(values)
        output["gppo_topk_ids"] = torch.cat(ids)
        output["gppo_topk_logp_old"] = torch.cat(topk_logp)
        output["gppo_logp_old"] = torch.cat(token_logp)
        return output

    def _compute_loss(self, model, inputs):
        cfg = self.gppo
        completion_ids = inputs["completion_ids"]
        mask = loss_mask(inputs)
        topk_ids = topk_logp = topk_logp_old = None
        if cfg.rollout_top_k:
            topk_ids = inputs["gppo_topk_ids"]
            logp, topk_logp, entropies = self._policy_topk(model, inputs)
            logp_old, topk_logp_old = inputs["gppo_logp_old"], inputs["gppo_topk_logp_old"]
        else:
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logp, entropies, _ = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                compute_entropy=True,
                **{key: inputs.get(key) for key in VISION_KEYS},
            )
            logp_old = inputs.get("old_per_token_logps")
            logp_old = logp.detach() if logp_old is None else logp_old
        sampling = inputs.get("sampling_per_token_logps")
        logp_behavior = logp_old if sampling is None else torch.where(sampling.isnan(), logp_old, sampling)
        batch = gppo.TokenBatch(
            logp=logp,
            logp_behavior=logp_behavior,
            logp_old=logp_old,
            advantages=inputs["advantages"],
            mask=mask,
            token_ids=completion_ids,
            topk_ids=topk_ids,
            topk_logp=topk_logp,
            topk_logp_behavior=topk_logp_old if sampling is None else None,
            topk_logp_old=topk_logp_old,
            logp_ref=inputs.get("ref_per_token_logps"),
        )

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_tokens = num_sequences = None
        if cfg.loss_agg_mode == "token-mean":
            num_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":  # the count spans the generation batch: rescale to one window
                num_tokens = num_tokens * accumulation / self.args.steps_per_generation
        else:
            num_sequences = mask.size(0) * accumulation
        return gppo_loss_and_metrics(self, mode, batch, cfg, entropies, num_tokens, num_sequences)


def gppo_loss_and_metrics(trainer, mode: str, batch: gppo.TokenBatch, cfg, entropies, num_tokens, num_sequences):
    """gppo.policy_loss on `batch`, logging into `trainer._metrics[mode]` gppo's metrics averaged over
    processes (each over the processes that have it) as gppo/<name>, and the token-mean `entropy`
    [B,T] as TRL's entropy. loss/policy is left out: TRL logs the loss."""
    loss, metrics = gppo.policy_loss(batch, cfg, num_tokens=num_tokens, num_sequences=num_sequences)
    gathered = gather_object([metrics])
    for name in sorted({key for m in gathered for key in m} - {"loss/policy"}):
        values = [m[name] for m in gathered if name in m]
        trainer._metrics[mode][f"gppo/{name}"].append(sum(values) / len(values))
    mask = batch.mask
    totals = trainer.accelerator.reduce(torch.stack([(entropies * mask).sum(), mask.sum().float()]), reduction="sum")
    trainer._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    return loss


# TokenBatch fields GPPOAsyncTrainer fills: the rollout worker records the sampled token's log-prob
# (mu) only, and there is no old-policy pass and no reference model.
ASYNC_PROVIDED_FIELDS = ("logp", "logp_behavior", "logp_old", "advantages", "mask", "token_ids")


def __getattr__(name: str):
    """GPPOAsyncConfig / GPPOAsyncTrainer, built on first access: trl.experimental.async_grpo is
    imported only then, so that this module imports without it."""
    if name in ("GPPOAsyncConfig", "GPPOAsyncTrainer"):
        return _async_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ASYNC_CLASSES: dict = {}


def _async_classes() -> dict:
    if _ASYNC_CLASSES:
        return _ASYNC_CLASSES
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    @dataclass
    class GPPOAsyncConfig(AsyncGRPOConfig):
        """TRL's AsyncGRPOConfig plus `gppo_preset` and `gppo_overrides` (as GPPOTrainerConfig).
        TRL's epsilon / epsilon_high (its clip) are refused when changed: the preset sets the loss."""

        gppo_preset: str = field(default="gppo", metadata={"help": "GPPO preset: " + ", ".join(gppo.PRESETS)})
        gppo_overrides: dict | str | None = field(
            default=None, metadata={"help": "GPPOConfig fields that override the preset (JSON on the command line)"}
        )

        def __post_init__(self):
            super().__post_init__()
            self.gppo_overrides = parse_overrides(self.gppo_overrides)
            defaults = {f.name: f.default for f in fields(AsyncGRPOConfig)}
            changed = [name for name in ("epsilon", "epsilon_high") if getattr(self, name) != defaults[name]]
            if changed:
                raise gppo.GPPOConfigError(
                    f"GPPOAsyncTrainer replaces TRL's loss, so {changed} would be ignored: choose the loss with "
                    "gppo_preset and gppo_overrides"
                )
            self.gppo_config()

        def gppo_config(self) -> gppo.GPPOConfig:
            """The preset with `gppo_overrides` and norm_length = max_completion_length (no KL term)."""
            return resolve_gppo_config(
                self.gppo_preset,
                self.gppo_overrides,
                self.max_completion_length,
                ASYNC_PROVIDED_FIELDS,
                kl_coef=0.0,
                kl_hint="AsyncGRPOTrainer has no reference model: gppo_overrides['kl_coef'] cannot be set",
                trainer="GPPOAsyncTrainer",
                hint="AsyncGRPOTrainer's rollout worker records the sampled token's log-prob only; use a binary "
                "estimator (e.g. dppo-binary-tv)",
            )

    class GPPOAsyncTrainer(AsyncGRPOTrainer):
        """TRL's AsyncGRPOTrainer with the GPPO loss. Takes AsyncGRPOTrainer's arguments, with
        `args=GPPOAsyncConfig(...)`; metrics are logged as gppo/<name>.

        Both anchors are the log-probs the rollout worker recorded for each sampled token (mu,
        `old_log_probs`): there is no old-policy pass, so anchor='old' and anchor='behavior' agree and
        the behavior weight pi_old / mu is 1. Aggregation normalisers reproduce TRL's: token-mean divides
        by the micro-batch's trained tokens per process times the accumulation steps (TRL's
        `global_n_tokens`), the sequence modes by the micro-batch's completions times the accumulation
        steps, seq-mean-token-sum-norm's length defaults to max_completion_length."""

        _tag_names = ["trl", "gppo", "async-grpo"]

        def __init__(self, model, reward_funcs=None, args=None, **kwargs):
            if not isinstance(args, GPPOAsyncConfig):
                raise TypeError(f"GPPOAsyncTrainer needs args=GPPOAsyncConfig(...), got {type(args).__name__}")
            super().__init__(model, reward_funcs, args=args, **kwargs)
            self.gppo = args.gppo_config()
            if self.aux_loss_enabled:
                raise gppo.GPPOConfigError(
                    "GPPOAsyncTrainer does not add the MoE router auxiliary loss; set router_aux_loss_coef=0"
                )

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:
                raise ValueError("GPPOAsyncTrainer.compute_loss returns the loss only")
            # This rank's packed row (inter-rank padding stripped) and its loss terms, as TRL's own loss reads them.
            row = inputs["attention_mask"].bool()
            terms = inputs["token_index"] >= 0
            token_index = inputs["token_index"][terms]
            segment = inputs["segment_id"][terms]
            tree = {key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}  # fmt: skip
            tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
            shift_labels = inputs["shift_labels"][row].unsqueeze(0)
            start = time.time()
            outputs = model(
                input_ids=inputs["input_ids"][row].unsqueeze(0),
                position_ids=inputs["position_ids"][row].unsqueeze(0),
                shift_labels=shift_labels,
                fused_lm_head=True,
                **tree,
            )
            self._last_forward_time_s = time.time() - start

            # Loss terms [M] -> [S,T]: completion s = segment_id, t = the term's rank within its completion.
            num_seq = int(segment.max()) + 1
            order = torch.sort(segment, stable=True).indices
            counts = torch.bincount(segment, minlength=num_seq)
            position = torch.empty_like(segment)
            position[order] = torch.arange(segment.numel(), device=segment.device) - (counts.cumsum(0) - counts)[segment[order]]  # fmt: skip
            where, shape = (segment, position), (num_seq, int(counts.max()))

            def lay_out(values):
                return values.new_zeros(shape).index_put(where, values)

            logp_mu = lay_out(inputs["old_log_probs"][terms])
            batch = gppo.TokenBatch(
                logp=lay_out(outputs.log_probs.flatten()[token_index]),
                logp_behavior=logp_mu,
                logp_old=logp_mu,
                advantages=lay_out(inputs["advantages"][terms]),
                mask=lay_out(torch.ones_like(segment)),
                token_ids=lay_out(shift_labels.flatten()[token_index]),
            )
            mode = "train" if self.model.training else "eval"
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            num_tokens = num_sequences = None
            global_n_tokens = inputs["global_n_tokens"][0]
            if self.gppo.loss_agg_mode == "token-mean":
                num_tokens = (global_n_tokens / self.accelerator.num_processes).clamp(min=1.0) * accumulation
            else:
                num_sequences = num_seq * accumulation
            entropy = lay_out(outputs.entropy.flatten()[token_index].detach())
            loss = gppo_loss_and_metrics(self, mode, batch, self.gppo, entropy, num_tokens, num_sequences)

            # TRL's per-step accounting (flushed by its step callback).
            n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
            mean_seq_len = float(inputs["mean_seq_len"][0])
            self._step_forward_tokens += n_forward_tokens
            self._step_trained_tokens += float(global_n_tokens)
            self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
            self._step_samples += n_forward_tokens / mean_seq_len
            self._step_forward_s += self._last_forward_time_s
            return loss

    for cls in (GPPOAsyncConfig, GPPOAsyncTrainer):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _ASYNC_CLASSES.update(GPPOAsyncConfig=GPPOAsyncConfig, GPPOAsyncTrainer=GPPOAsyncTrainer)
    return _ASYNC_CLASSES
