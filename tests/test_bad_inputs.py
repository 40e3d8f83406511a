"""Every bad input is answered in words: the table of docs/bad-inputs.md, run row by row through
`gppo.cli.main` (exit status 2, one line naming the field, the value and the fix, no traceback),
the Python API's answers, and the values that are converted rather than refused, the same way from
every source (flags, YAML, Python)."""

import importlib.util
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch

import gppo
from gppo.cli import main
from gppo.commands.eval import EvalConfig
from gppo.evaluation import evaluate
from gppo.options import CLI, ConfigError, convert, load_yaml, specs, yaml_source
from gppo.problem import Problem
from gppo.rewards.pipeline import RewardPipeline
from gppo.trainer.config import TrainConfig, config_values, from_dict

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad-inputs.md"
ROW = re.compile(r"^\| `(gppo [^`]+)` \| `([^`]+)` \|$")


def doc_rows():
    rows = [ROW.match(line).groups() for line in DOC.read_text().splitlines() if ROW.match(line)]
    assert len(rows) > 60, "docs/bad-inputs.md lost its tables"
    return rows


def environment_allows(answer: str) -> bool:
    """Rows about a missing GPU or vLLM hold only where they are missing."""
    if "needs a CUDA GPU" in answer:
        return not torch.cuda.is_available()
    if "needs vLLM" in answer:
        return importlib.util.find_spec("vllm") is None
    return True


@pytest.mark.parametrize("command,answer", doc_rows(), ids=[c for c, _ in doc_rows()])
def test_documented_bad_input_gets_its_answer(command, answer, micro_model, tmp_path, capsys, monkeypatch):
    if not environment_allows(answer):
        pytest.skip("this machine has what the row lacks")
    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    argv = [a.replace("MODEL", str(micro_model)).replace("TMP", str(tmp_path)) for a in shlex.split(command)]
    try:
        status = main(argv[1:])
    finally:
        torch.set_num_threads(threads)  # a Trainer that got far enough sets the thread count
    err = capsys.readouterr().err.replace(str(tmp_path), "TMP").replace(str(micro_model), "MODEL")
    assert status == 2, err
    assert "Traceback" not in err
    prefix = (
        f"gppo {argv[1]}: error: "
        if argv[1] in ("train", "eval", "sweep", "probe", "geometry", "warmstart", "presets")
        else "gppo: error: "
    )
    assert err.count("error:") == 1 and prefix in err, err
    message = err[err.index(prefix) + len(prefix) :]
    position = 0
    for piece in (p.strip() for p in answer.split("…")):
        found = message.find(piece, position)
        assert found >= 0, f"{piece!r} not in {message!r}"
        position = found + len(piece)


# ------------------------------------------------------------------------------ one validation, every source
@pytest.mark.parametrize(
    "field,raw,value",
    [
        ("lr", "1e-3", 1e-3),  # YAML 1.1 reads 1e-3 as a string
        ("chat_template", "no", "false"),  # a quoted "no" is false, not a truthy string
        ("chat_template", "YES", "true"),
        ("progress", 0, False),
        ("reward_weights", ["1", "0.5"], [1.0, 0.5]),
        ("report_to", ["tensorboard"], ["tensorboard"]),
        ("threads", "none", None),
        ("steps", 3.0, 3),
    ],
)
def test_values_are_converted_alike_from_every_source(field, raw, value, tmp_path):
    spec = specs(TrainConfig)[field]
    assert convert(spec, raw, CLI) == value
    assert convert(spec, raw, yaml_source("x.yaml")) == value
    extra = {"reward_funcs": ["tests.reward_fns:length_bonus"]} if field == "reward_weights" else {}
    assert getattr(from_dict({field: raw, **extra}), field) == value


@pytest.mark.parametrize("raw", ["maybe", "on", "t", 2, 0.5, "", "truee"])
def test_booleans_parse_strictly(raw):
    with pytest.raises(ConfigError, match="is not true or false"):
        convert(specs(TrainConfig)["progress"], raw, CLI)


def test_yaml_and_flags_meet_in_one_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        'lr: 1e-3\nchat_template: "no"\nreward_funcs: [tests.reward_fns:length_bonus]\n'
        "reward_weights: [1, 0.5]\nloss:\n  delta_high: '0.2'\n"
    )
    values = config_values({"config": str(path), "steps": "7", "divergence": "kl"})
    config = from_dict(values)
    assert (config.lr, config.chat_template, config.reward_weights, config.steps) == (1e-3, "false", [1.0, 0.5], 7)
    assert (config.gppo_config().delta_high, config.gppo_config().divergence) == (0.2, "kl")
    assert load_yaml(path)["lr"] == "1e-3"  # what YAML 1.1 gives; the validation converts it


def test_flags_convert_typed_lists(micro_model, tmp_path, capsys):
    """--reward_weights from the command line used to stay strings and fail in the reward sum."""
    from gppo.commands.train import parser

    args = parser().parse(
        [
            "--reward_funcs",
            "tests.reward_fns:length_bonus",
            "--reward_weights",
            "1",
            "0.5",
            "--chat_template",
            "--progress",
            "FALSE",
            "--norm_length",
            "none",
        ]
    )
    values = config_values(args)
    assert values["reward_weights"] == [1.0, 0.5] and values["chat_template"] == "true"
    assert values["progress"] is False and values["norm_length"] is None


def test_python_construction_is_validated_too():
    with pytest.raises(ConfigError, match=r"TrainConfig.lr: 'abc' is not a number; give e.g. lr=0.0001"):
        TrainConfig(lr="abc")
    with pytest.raises(ConfigError, match=r"unknown config key 'lrr' \(did you mean 'lr'\?\)"):
        from_dict({"lrr": 0.1})
    with pytest.raises(ConfigError, match=r"TrainConfig.loss\['delta_high'\]: 'x' is not a number"):
        TrainConfig(loss={"delta_high": "x"})
    assert TrainConfig(lr="3e-4").lr == 3e-4
    with pytest.raises(ConfigError, match="either --benchmark .* or --task, not neither"):
        EvalConfig(model="m")
    with pytest.raises(ConfigError, match="EvalConfig.n must be >= 1"):
        EvalConfig(model="m", task="addition", n=0)


def test_help_of_every_command(capsys):
    for command in ("train", "eval", "presets", "warmstart", "sweep", "probe", "geometry"):
        assert main([command, "--help"]) == 0
        assert f"usage: gppo {command}" in capsys.readouterr().out
    assert main([]) == 0 and "warmstart" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the Python API
def small_batch(**changes):
    logp = torch.log(torch.full((2, 3), 0.4))
    values = dict(logp=logp, logp_behavior=logp - 0.1, advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, 3))
    return gppo.TokenBatch(**{**values, **changes})


@pytest.mark.parametrize("count", [0, -3, float("nan"), torch.tensor(0.0)])
def test_policy_loss_refuses_a_count_that_is_not_positive(count):
    with pytest.raises(gppo.GPPOInputError, match=r"num_tokens=.* must be > 0"):
        gppo.policy_loss(small_batch(), gppo.preset("ppo"), num_tokens=count)
    with pytest.raises(gppo.GPPOInputError, match=r"num_sequences=.* must be > 0"):
        gppo.policy_loss(small_batch(), gppo.preset("grpo"), num_sequences=count)


@pytest.mark.parametrize("field", ["logp", "logp_behavior", "logp_old"])
def test_log_probs_above_zero_are_refused(field):
    bad = torch.log(torch.full((2, 3), 0.4))
    bad[1, 2] = 0.7  # a probability of 2
    config = gppo.preset("ppo", anchor="old") if field == "logp_old" else gppo.preset("ppo")
    with pytest.raises(gppo.GPPOInputError, match=f"TokenBatch.{field} has log-probs > 0: a probability above 1"):
        gppo.policy_loss(small_batch(**{field: bad}), config)
    padding = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # padding may hold anything
    loss, _ = gppo.policy_loss(small_batch(**{field: bad, "mask": padding}), config)
    assert torch.isfinite(loss)


def test_log_probs_at_rounding_level_pass():
    """Log-probs computed in low precision may exceed 0 by rounding: tolerated up to LOGP_MAX = 0.1."""
    loss, _ = gppo.policy_loss(
        small_batch(logp=torch.full((2, 3), 0.05), logp_behavior=torch.full((2, 3), 1e-3)), gppo.preset("ppo")
    )
    assert torch.isfinite(loss)


def verifier(problems, completions):
    return [1.0] * len(completions)


PROBLEMS = [Problem("1+1=", "2")] * 2


def test_a_huge_reward_is_blamed_on_the_reward():
    """A reward function's 1e308 used to overflow the float32 advantages and be reported as bad
    log-probs; it is now that function's counted warning, and a total overflow names its parts."""
    huge = [("tests:huge", lambda completions, **_: [1e308, 0.5])]
    with pytest.warns(RuntimeWarning, match=r"tests:huge: 1 of 2 samples gave no finite reward within \+-1e\+06"):
        result = RewardPipeline(verifier, huge)(PROBLEMS, ["2", "3"], [[1], [2]])
    assert result.rewards == [1.0, 1.5]
    big = [("tests:big", lambda completions, **_: [1e6, 1.0])]
    with pytest.raises(
        ValueError,
        match=r"the reward of sample 0 is 1e\+12 \(verifier 1, tests:big 1e\+06; "
        r"weights \[1.0, 1000000.0\]\), beyond \+-1e\+06: lower reward_weights",
    ):
        RewardPipeline(verifier, big, weights=[1.0, 1e6])(PROBLEMS, ["2", "3"], [[1], [2]])


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(weights=["1"]), r"reward_weights\[0\] = '1' is not a number within"),
        (dict(weights=[float("inf")]), r"reward_weights\[0\] = inf is not a number"),
        (dict(weights=[1.0, 2.0]), "reward_weights has 2 values but there is 1 reward"),
        (dict(format_reward=float("nan")), "format_reward = nan is not a number"),
        (dict(format_pattern="("), r"format_pattern '\(' is not a valid regular expression"),
    ],
)
def test_reward_pipeline_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        RewardPipeline(verifier, **changes)


def test_evaluate_refuses_a_benchmark_without_a_readable_row(tmp_path):
    class NoEngine:
        def generate(self, prompts, params):
            raise AssertionError("nothing may be generated")

    with pytest.raises(ValueError, match="benchmark aime24: none of its 1 rows could be read .*missing field"):
        evaluate(
            NoEngine(),
            ["aime24"],
            {"aime24": ROOT / "tests/fixtures/benchmarks/unknown_schema.jsonl"},
            out_dir=tmp_path,
            progress=False,
        )


def test_trl_overrides_share_the_validation(tmp_path):
    pytest.importorskip("trl")
    from transformers import HfArgumentParser

    from gppo.integrations.trl import GPPOTrainerConfig, parse_overrides

    assert parse_overrides('{"delta_high": "0.2", "divergence": "kl"}') == {"delta_high": 0.2, "divergence": "kl"}
    assert parse_overrides(None) == {} and parse_overrides(" ") == {}
    with pytest.raises(gppo.GPPOConfigError, match=r"gppo_overrides\['delta_high'\]: 'abc' is not a number"):
        parse_overrides({"delta_high": "abc"})
    with pytest.raises(gppo.GPPOConfigError, match=r"unknown config key 'delta_hihg' \(did you mean 'delta_high'"):
        parse_overrides({"delta_hihg": 0.2})
    with pytest.raises(gppo.GPPOConfigError, match=r"gppo_overrides: \[1\] is not a mapping"):
        parse_overrides([1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            gppo.GPPOConfigError,
            match=r"is not JSON \(Expecting property name enclosed in double "
            r"quotes at column 2\); give e.g.",
        ):
            HfArgumentParser(GPPOTrainerConfig).parse_args_into_dataclasses(
                ["--output_dir", str(tmp_path), "--use_cpu", "true", "--gppo_overrides", "{divergence: kl}"]
            )


def test_fields_without_a_command_line_form_pass_unchanged():
    """A field typed as an object or a union of types is its owner's to check (GPPOConfig checks
    its own values); it gets no flag."""
    import argparse
    import dataclasses

    from gppo.options import add_arguments, check, option

    @dataclasses.dataclass
    class Options:
        rule: object = option(None, "an object")
        either: int | str | None = option(None, "a union")
        steps: int = option(1, "an integer", ge=1)

    marker = object()
    assert check(Options, {"rule": marker, "either": "x"}, CLI) == {"rule": marker, "either": "x"}
    parser = argparse.ArgumentParser()
    add_arguments(parser, Options)
    assert [a.dest for a in parser._actions if a.dest != "help"] == ["steps"]
