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

from gppo.core import GPPOConfig
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
from gppo.rewards.pipeline import check_reward_weights
from gppo.rollout.options import device_option, refuse_vllm_options_without_vllm
from gppo.tasks import TASKS
from gppo.trainer.config_adapters import AdapterOptions
from gppo.trainer.config_inputs import InputOptions
from gppo.trainer.config_rewards import RewardOptions
from gppo.trainer.config_rollout import UNSET_DEFAULTS, RolloutOptions
from gppo.trainer.config_update import NO_WARMUP_SCHEDULES, UpdateOptions

_opt = option
PYTHON = Source("python", "TrainConfig")


@dataclass
class TrainConfig(AdapterOptions, UpdateOptions, RewardOptions, RolloutOptions, InputOptions):
    """Configuration of one RL run (defaults: the embedded addition task, about 2 minutes on 2 CPU cores)."""

    # The bases declare the options of each concern; dataclasses order fields from the last base to the
    # first, then these: model and data, objective, rollout, rewards, update, LoRA, tools, evaluation, run
    # (the order of --help and config.yaml).

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
