"""Tool tokens are neither the model's length nor its answer, and the defaults leave room for a call.

Completions are scripted as ToolEngine returns them (model segments, tool segments with mask 0),
tokenized by the multiplication task's character tokenizer (one token per character), so that the
expected lengths are counted from the script's text, independently of `tool_mask`.
"""

import warnings

import pytest
import torch

from gppo.commands.sweep import plan
from gppo.commands.train import parser
from gppo.evaluation import evaluate_problems
from gppo.models.embedded import build_tokenizer
from gppo.options import ConfigError, check
from gppo.problem import Problem
from gppo.rewards.pipeline import RewardPipeline, overlong_penalty
from gppo.rollout import Generation, SamplingParams
from gppo.tasks import TASKS, get_task, heldout_problems
from gppo.tool_format import FENCE, output_block
from gppo.trainer import config_rollout
from gppo.trainer.config import PYTHON, TrainConfig, config_from_args, from_dict
from gppo.trainer.data import TaskSource
from gppo.trainer.generation import RolloutGenerator

TOKENIZER = build_tokenizer(get_task("multiplication").extra_chars)
MAX_NEW_TOKENS, BUFFER = 64, 24  # the run: a correct 36-token answer with 21 tool tokens got -0.708


def call(a: int, b: int) -> list[tuple[str, str]]:
    return [("model", f"{FENCE}python\nprint({a}*{b})\n{FENCE}\n"), ("tool", output_block(str(a * b)))]


def honest(a: int, b: int):
    """Calls the tool, then writes the product in its own tokens."""
    return [*call(a, b), ("model", str(a * b))], "stop"


def imitation(a: int, b: int):
    """A program whose output imitates the answer ("\\n```\\n<product>"), its output block cut right
    after it (by the budget), and no answer of the model's own."""
    code = f"{FENCE}python\nprint(chr(10)+chr(96)*3+chr(10)+str({a}*{b}))\n{FENCE}\n"
    fake = output_block(f"\n{FENCE}\n{a * b}")
    return [("model", code), ("tool", fake[: fake.rindex(str(a * b)) + len(str(a * b))])], "length"


def in_its_head(a: int, b: int):
    return [("model", str(a * b + 1))], "stop"


def model_length(segments, finish: str) -> int:
    return sum(len(text) for kind, text in segments if kind == "model") + (finish == "stop")  # + EOS


class ScriptedEngine:
    """Sample j of every prompt follows scripts[j % len(scripts)]: (segments, finish_reason)."""

    max_top_k_logprobs, separate_weights = 20, False

    def __init__(self, *scripts):
        self.scripts = scripts

    def generate(self, prompts, params):
        gens = []
        for i, prompt in enumerate(prompts):
            a, b = map(int, prompt.rstrip("=").split("*"))
            for j in range(params.n):
                segments, finish = self.scripts[j % len(self.scripts)](a, b)
                ids, mask = [], []
                for kind, text in segments:
                    piece = TOKENIZER(text, add_special_tokens=False)["input_ids"]
                    ids, mask = ids + piece, mask + [int(kind == "model")] * len(piece)
                if finish == "stop":
                    ids, mask = ids + [TOKENIZER.eos_token_id], mask + [1]
                k = params.top_k_logprobs
                gens.append(
                    Generation(
                        i,
                        TOKENIZER(prompt)["input_ids"],
                        ids,
                        TOKENIZER.decode(ids, skip_special_tokens=True),
                        logprobs=[-0.5 * m for m in mask],
                        topk_ids=[[t] * k for t in ids] if k else None,
                        topk_logprobs=[[-0.5] * k for _ in ids] if k else None,
                        finish_reason=finish,
                        tool_mask=mask,
                        tool_calls=int(0 in mask),
                    )
                )
        return gens


def generator(engine, **settings) -> RolloutGenerator:
    config = TrainConfig(task="multiplication", tools=["python"], max_new_tokens=MAX_NEW_TOKENS, **settings)
    task = get_task("multiplication")
    rewards = RewardPipeline(
        lambda ps, cs: [task.score(p, c) for p, c in zip(ps, cs)],
        format_pattern=config.format_pattern,
        format_reward=config.format_reward,
        max_length=config.max_new_tokens,
        overlong_buffer=config.overlong_buffer,
    )
    return RolloutGenerator(
        config, config.gppo_config(), TaskSource(task, 0), str, engine, rewards, TOKENIZER, None, torch.device("cpu")
    )


# ------------------------------------------------------------------------------ lengths
def test_the_overlong_penalty_and_the_length_metrics_count_the_models_tokens_only():
    """The issue's completion: the product after a call, 36 model tokens and 57 in all. The penalty
    (last 24 of 64 tokens) starts after 40 tokens: the model's 36 get none (the whole 57 got -0.708),
    and rollout/length_mean and the sampling speed count the 36."""
    rollout, stats = generator(ScriptedEngine(honest), prompts_per_step=4, group_size=2, overlong_buffer=BUFFER)(0)
    a, b = 347, 829
    assert model_length(*honest(a, b)) == 36 and len(TOKENIZER(output_block(str(a * b)))["input_ids"]) == 21
    problems = TaskSource(get_task("multiplication"), 0).take(4)
    lengths = [model_length(*honest(p.metadata["a"], p.metadata["b"])) for p in problems]
    assert all(length < MAX_NEW_TOKENS - BUFFER for length in lengths)
    assert stats["rollout/length_mean"] == pytest.approx(sum(lengths) / 4)
    assert stats["rollout/length_max"] == max(lengths)
    assert stats["rollout/accuracy"] == 1.0 and stats["rollout/reward_mean"] == 1.0  # no penalty
    assert rollout.response_mask.sum() == 2 * sum(lengths)  # the loss's lengths: the model's tokens too
    assert overlong_penalty(57, MAX_NEW_TOKENS, BUFFER) == pytest.approx(-17 / 24)  # what the total gave


def test_eval_lengths_count_the_models_tokens_only():
    problems = heldout_problems(get_task("multiplication"), 3)
    task = get_task("multiplication")
    result = evaluate_problems(
        ScriptedEngine(honest),
        problems,
        lambda ps, cs: [task.score(p, c) for p, c in zip(ps, cs)],
        [p.prompt for p in problems],
        2,
        1.0,
        MAX_NEW_TOKENS,
        seed=0,
        tokenizer=TOKENIZER,
    )
    lengths = [model_length(*honest(p.metadata["a"], p.metadata["b"])) for p in problems]
    assert result["eval/length_mean"] == pytest.approx(sum(lengths) / 3)
    assert result["eval/greedy"] == 1.0 and result["eval/avg@k"] == 1.0


# ------------------------------------------------------------------------------ answers
def test_a_tool_output_that_imitates_the_answer_scores_nothing():
    """The imitation's whole text ends with a fence and the product, the model's own text with its
    block: it scores 0 and gets no format bonus; the model's own answer after the output scores 1."""
    a, b = 347, 829
    whole = "".join(text for _, text in imitation(a, b)[0])
    assert whole.endswith(f"{FENCE}\n{a * b}")  # what the task read before
    engine = ScriptedEngine(honest, imitation, in_its_head)
    _, stats = generator(engine, prompts_per_step=1, group_size=3, format_pattern=r".*```\n\d+", format_reward=0.5)(0)
    assert stats["rollout/accuracy"] == pytest.approx(1 / 3)  # the honest sample alone
    assert stats["rollout/reward_mean"] == pytest.approx(1.5 / 3)  # its format bonus alone

    problems = heldout_problems(get_task("multiplication"), 2)
    task = get_task("multiplication")

    def evaluated(engine):
        verifier = lambda ps, cs: [task.score(p, c) for p, c in zip(ps, cs)]  # noqa: E731
        prompts = [p.prompt for p in problems]
        return evaluate_problems(engine, problems, verifier, prompts, 2, 1.0, MAX_NEW_TOKENS, 0, tokenizer=TOKENIZER)

    assert evaluated(ScriptedEngine(imitation))["eval/greedy"] == 0.0
    assert evaluated(ScriptedEngine(honest))["eval/greedy"] == 1.0
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate_problems(ScriptedEngine(honest), problems, lambda ps, cs: [0.0] * len(cs), ["1*2="] * 2, 1, 1.0, 9, 0)


def test_reward_functions_get_the_whole_completion_and_the_tool_mask():
    """TRL's columns (the whole text and ids, tool outputs included), plus tool_mask with tools;
    without tools no tool_mask."""
    seen = []

    def record(prompts, completions, completion_ids, **columns):
        seen.append((completions, completion_ids, columns.get("tool_mask", "absent")))
        return [0.0] * len(completions)

    gens = ScriptedEngine(honest).generate(["12*34="], SamplingParams(n=1))
    pipeline = RewardPipeline(None, [("record", record)])
    pipeline([Problem("12*34=", "408")], [gens[0].text], [gens[0].completion_ids], [gens[0].tool_mask], TOKENIZER)
    pipeline([Problem("12*34=", "408")], ["408"], [[1, 2, 3]])
    assert seen[0] == ([gens[0].text], [gens[0].completion_ids], [gens[0].tool_mask])
    assert "```output" in seen[0][0][0] and 0 in seen[0][2][0]
    assert seen[1][2] == "absent"


# ------------------------------------------------------------------------------ truncation
def test_a_step_whose_completions_are_mostly_cut_warns_once_per_run():
    """Half cut: no warning; all cut: one warning naming the flag and its value; later steps: none."""
    cut = lambda a, b: ([("model", f"{FENCE}python\nprint(")], "length")  # noqa: E731
    half = generator(ScriptedEngine(honest, cut), prompts_per_step=2, group_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        half(0)
    assert not [w for w in caught if "max_new_tokens" in str(w.message)]
    run = generator(ScriptedEngine(cut), prompts_per_step=2, group_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            run(step)
    said = [str(w.message) for w in caught if "max_new_tokens" in str(w.message)]
    assert len(said) == 1, said
    assert f"100% of the completions of step 1 hit --max_new_tokens {MAX_NEW_TOKENS}" in said[0]
    assert "raise --max_new_tokens" in said[0] and "tool calls" in said[0]


# ------------------------------------------------------------------------------ defaults
def test_a_tasks_defaults_fill_only_what_the_run_leaves_unset(tmp_path):
    """multiplication's max_new_tokens is 64 unless set, from Python, flags, YAML or a sweep, even
    when set to the general default; other tasks and --data keep 24."""
    assert TrainConfig(task="multiplication", tools=["python"]).max_new_tokens == 64
    assert TrainConfig(task="multiplication").to_dict()["max_new_tokens"] == 64  # what config.yaml records
    assert TrainConfig(task="multiplication", max_new_tokens=24).max_new_tokens == 24
    assert TrainConfig().max_new_tokens == 24 and TrainConfig(task="countdown").max_new_tokens == 24
    assert TrainConfig(data="x.jsonl").max_new_tokens == 24

    def flags(*argv):
        return config_from_args(parser().parse(list(argv))).max_new_tokens

    assert flags("--task", "multiplication", "--tools", "python") == 64
    assert flags("--task", "multiplication", "--max_new_tokens", "24") == 24
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("task: multiplication\nmax_new_tokens: 24\n")
    assert flags("--config", str(yaml_file)) == 24
    yaml_file.write_text("task: multiplication\n")
    assert flags("--config", str(yaml_file)) == 64
    assert from_dict({"task": "multiplication", "max_new_tokens": 64, "overlong_buffer": 30}).overlong_buffer == 30

    def swept(**base):
        return plan({"task": "multiplication", "tools": ["python"], **base}, tmp_path, seeds=[0], presets=["gppo"])

    assert swept()[0].config.max_new_tokens == 64
    assert swept(max_new_tokens=24)[0].config.max_new_tokens == 24


def test_every_task_default_is_a_setting_a_run_can_leave_unset():
    """A task default applies where the setting is None, so its field must default to None (and the
    value must pass the setting's validation); --help states each."""
    defaults = {name: getattr(cls, "defaults", {}) for name, cls in TASKS.items()}
    assert defaults["multiplication"] == {"max_new_tokens": 64}
    for task, values in defaults.items():
        assert set(values) <= set(config_rollout.UNSET_DEFAULTS), task
        check(TrainConfig, values, PYTHON)
    for name in config_rollout.UNSET_DEFAULTS:
        assert TrainConfig.__dataclass_fields__[name].default is None
    assert "unset: 24, or the built-in task's own (multiplication 64)" in " ".join(parser().format_help().split())


# ------------------------------------------------------------------------------ tool workers
def test_tool_workers_is_a_tool_setting():
    """Set with --tools, refused without (it would be ignored) or below 1, listed with the tools."""
    assert TrainConfig(tools=["python"], tool_workers=2).tool_workers == 2
    assert TrainConfig(tools=["python"]).tool_workers is None  # the tool engine's default
    with pytest.raises(ConfigError, match="--tool_workers 2 would be ignored: it applies with --tools python"):
        TrainConfig(tool_workers=2)
    with pytest.raises(ConfigError, match=r"--tool_workers must be >= 1 \(got 0\)"):
        config_from_args(parser().parse(["--tools", "python", "--tool_workers", "0"]))
    tools_group = next(g for g in parser()._action_groups if g.title == "tools")
    assert "tool_workers" in [a.dest for a in tools_group._group_actions]
