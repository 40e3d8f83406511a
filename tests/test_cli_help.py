"""`--help` of every command: each flag states its default once; --model names every form it takes."""

import re

import pytest

from gppo.cli import main
from gppo.commands import COMMANDS
from gppo.models.loading import NAMED_MODELS


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_flag_states_its_default_at_most_once(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    flags = re.split(r"(?<= )(?=--\w+ )", text.split("options:", 1)[-1])
    repeated = []
    for flag in flags:  # an appended "(default: X)" must be the only word on the default
        suffix = re.search(r"\(default: [^()]*\)\s*$", flag)
        if suffix and re.search(r"\bdefault\b|\bunset:", flag[: suffix.start()], re.I):
            repeated.append(flag)
    assert not repeated, repeated


@pytest.mark.parametrize("command", ["train", "eval"])
def test_model_help_names_every_accepted_form(command, capsys):
    main([command, "--help"])
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    model_help = " ".join(re.split(r"\n  -", raw.split("\n  --model TEXT", 1)[1], maxsplit=1)[0].split())
    for form in (
        "Hugging Face causal-LM directory",
        ".gguf file",
        "directory holding one .gguf file",
        "smollm2",
        NAMED_MODELS["smollm2"].install,
    ):
        assert form in model_help, form
    if command == "train":
        assert "float32, bfloat16 or float16" in text
