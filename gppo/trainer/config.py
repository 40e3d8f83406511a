"""`TrainConfig`: every knob of `gppo train`, documented once and exposed to YAML and the CLI.

Precedence: dataclass defaults < YAML file (`--config x.yaml`) < command-line `--key value`.
The objective is `preset` plus optional overrides of any `GPPOConfig` field (`--divergence kl`),
kept in `loss`. Unknown keys are errors that name the closest valid key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from gppo.core.config import GPPOConfig, GPPOConfigError, preset as build_preset


class ConfigError(ValueError):
    """A bad training configuration; the message names the key and the fix."""


def _opt(default, help: str, group: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, "group": group}, **kw)
    return field(default=default, metadata={"help": help, "group": group}, **kw)


@dataclass
class TrainConfig:
    """Configuration of one RL run (defaults: the embedded addition task, about 2 minutes on 2 CPU cores)."""

    # model and data
    model: str | None = _opt(None, "Hugging Face causal-LM directory; default: the embedded tiny Qwen2, "
                             "warm-started on --task", "model and data")
    task: str = _opt("addition", "built-in task with an exact verifier (addition, countdown), used when "
                     "--data is not given", "model and data")
    data: str | None = _opt(None, "training data file (JSONL/Parquet; DAPO-Math-17k, DeepScaleR, "
                            "Skywork-OR1 schemas, auto-detected)", "model and data")
    eval_data: str | None = _opt(None, "held-out data file (default: the first eval_size records of "
                                 "--data are held out)", "model and data")
    prompt_template: str = _opt("{prompt}", "format of each prompt; {prompt} is the problem text",
                                "model and data")
    chat_template: bool = _opt(False, "wrap prompts with the tokenizer's chat template", "model and data")

    # objective
    preset: str = _opt("gppo", "GPPO preset (see `gppo presets`); any GPPOConfig field below overrides it",
                       "objective")
    loss: dict = _opt({}, "GPPOConfig overrides (set them with their own flags, e.g. --divergence kl)",
                      "objective")

    # rollout
    engine: str = _opt("hf", "rollout engine: hf (transformers, CPU/GPU) or vllm (GPU, gppo[vllm])",
                       "rollout")
    prompts_per_step: int = _opt(32, "prompts per RL step", "rollout")
    group_size: int = _opt(8, "completions sampled per prompt", "rollout")
    temperature: float = _opt(1.0, "sampling temperature (applied identically in rollout and training)",
                              "rollout")
    max_new_tokens: int = _opt(24, "maximum completion length", "rollout")
    rollout_top_p: float = _opt(1.0, "nucleus sampling of training rollouts (TRL's and verl's rollout top_p; "
                                "1: off): pi is scored on the same truncated, renormalised distribution, so "
                                "r = 1 before the first update. Not --top_p, the topp estimator's nucleus", "rollout")
    rollout_batch_size: int = _opt(256, "sequences generated together", "rollout")
    vllm_gpu_memory: float = _opt(0.5, "vLLM gpu_memory_utilization (engine=vllm)", "rollout")

    # rewards and advantages
    reward_funcs: list = _opt([], "extra reward functions as module:function, called like TRL's "
                              "(prompts=, completions=, completion_ids=, answer=, **columns)",
                              "rewards and advantages")
    reward_weights: list = _opt([], "weights of the verifier followed by each reward function "
                                "(default all 1)", "rewards and advantages")
    overlong_buffer: int = _opt(0, "DAPO soft overlong penalty: the last N tokens before max_new_tokens "
                                "are penalised linearly down to -1 (0: off)", "rewards and advantages")
    format_pattern: str | None = _opt(None, "regular expression a well-formed completion matches "
                                      "(re.fullmatch on the stripped text)", "rewards and advantages")
    format_reward: float = _opt(0.0, "reward added when format_pattern matches", "rewards and advantages")
    advantage: str = _opt("grpo", "advantage estimator: grpo, dr_grpo, rloo, reinforce++",
                          "rewards and advantages")
    dynamic_sampling: bool = _opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal "
                                  "and refill with new prompts", "rewards and advantages")
    max_resample_rounds: int = _opt(4, "dynamic sampling: extra rollout rounds per step at most",
                                    "rewards and advantages")

    # update
    steps: int = _opt(60, "RL steps (rollout + update)", "update")
    epochs: int = _opt(2, "passes over each rollout batch", "update")
    mini_batch_size: int = _opt(128, "sequences per optimizer step", "update")
    micro_batch_size: int = _opt(128, "sequences per forward/backward (gradient accumulation)", "update")
    lr: float = _opt(1e-4, "AdamW learning rate", "update")
    lr_schedule: str = _opt("constant", "transformers scheduler name: constant, linear, cosine, ... "
                            "(with warmup)", "update")
    warmup_steps: int = _opt(0, "optimizer steps of linear warm-up", "update")
    weight_decay: float = _opt(0.0, "AdamW weight decay", "update")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm (0: off)", "update")

    # evaluation
    eval_every: int = _opt(20, "evaluate every N steps (and before and after training; 0: only then)",
                           "evaluation")
    eval_size: int = _opt(1024, "held-out problems per evaluation", "evaluation")
    eval_samples: int = _opt(4, "sampled completions per problem for avg@k (greedy is always reported)",
                             "evaluation")

    # run
    output_dir: str | None = _opt(None, "run directory (default: runs/<task>-<preset>-s<seed>)", "run")
    seed: int = _opt(0, "random seed (data order, sampling, shuffling)", "run")
    device: str = _opt("auto", "cpu, cuda, or auto", "run")
    dtype: str = _opt("float32", "parameter dtype: float32 or bfloat16", "run")
    threads: int | None = _opt(None, "torch CPU threads (default: the cores not busy with other work)", "run")
    save_every: int = _opt(20, "checkpoint every N steps (0: only at the end)", "run")
    keep_checkpoints: int = _opt(2, "checkpoints kept (older ones are deleted)", "run")
    report_to: list = _opt([], "extra loggers: tensorboard, wandb (when installed)", "run")
    progress: bool = _opt(True, "show a progress bar", "run")

    def __post_init__(self):
        self.gppo_config()  # validates the objective early, with the preset's message

    def gppo_config(self) -> GPPOConfig:
        try:
            return build_preset(self.preset, **self.loss)
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


def closest_key(key: str) -> str:
    match = difflib.get_close_matches(key, ALL_KEYS, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from flat keys (trainer fields and GPPOConfig fields), unknown keys refused."""
    train, loss = {}, dict(values.get("loss") or {})
    for key, value in values.items():
        if key == "loss":
            continue
        if key in TRAIN_FIELDS:
            train[key] = value
        elif key in LOSS_FIELDS:
            loss[key] = value
        else:
            raise ConfigError(f"unknown config key {key!r}{closest_key(key)}; `gppo train --help` lists all keys")
    return TrainConfig(**train, loss=loss)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return data


# ---------------------------------------------------------------------------------------- CLI
def _base_type(annotation):
    """(python type, is_list) of a field annotation such as `int | None` or `list`."""
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    base = next(h for h in hints if h is not type(None))
    return base, base is list


def _parser_type(base):
    def convert(text: str):
        if text.lower() in ("none", "null"):
            return None
        if base is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
        return base(text)
    convert.__name__ = base.__name__
    return convert


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per TrainConfig field and per GPPOConfig field, with its help, grouped."""
    parser.add_argument("--config", help="YAML file of keys (any flag below, without the dashes)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    hints = typing.get_type_hints(TrainConfig)
    for name, f in TRAIN_FIELDS.items():
        group_name = f.metadata["group"]
        group = groups.setdefault(group_name, parser.add_argument_group(group_name))
        base, is_list = _base_type(hints[name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = dict(dest=name, default=argparse.SUPPRESS, help=f"{f.metadata['help']} (default: {default})")
        if is_list:
            group.add_argument(f"--{name}", nargs="*", **kwargs)
        else:
            group.add_argument(f"--{name}", type=_parser_type(base), metavar=base.__name__.upper(), **kwargs)
    objective = groups["objective"]
    loss_hints = typing.get_type_hints(GPPOConfig)
    for name, f in LOSS_FIELDS.items():
        base, _ = _base_type(loss_hints[name])
        objective.add_argument(f"--{name}", dest=name, type=_parser_type(base), metavar=base.__name__.upper(),
                               default=argparse.SUPPRESS,
                               help=f"{f.metadata['help']} (default: from the preset)")


def config_values(args: argparse.Namespace) -> dict:
    """The training keys given, flat (TrainConfig and GPPOConfig fields): --config YAML < flags."""
    values = load_yaml(args.config) if getattr(args, "config", None) else {}
    values.update(values.pop("loss", None) or {})
    values.update({k: v for k, v in vars(args).items() if k in TRAIN_FIELDS or k in LOSS_FIELDS})
    return values


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config YAML < flags."""
    return from_dict(config_values(args))
