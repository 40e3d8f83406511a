"""The shared prompt builder: options and their errors, conversations, the chat-template round trip
on the real SmolLM2 tokenizer, and the same builder in train and eval."""

import copy

import pytest

from gppo.data.loaders import MATH_INSTRUCTION
from gppo.models.embedded import build_tokenizer
from gppo.prompts import PromptBuilder, PromptConfig
from gppo.trainer import ConfigError
from gppo.trainer.config import from_dict

# a toy template whose rendering can be written by hand: <role>content|, then <assistant>
TOY_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_tokenizer()  # the embedded tokenizer: no chat template


@pytest.fixture(scope="module")
def toy_chat_tokenizer(char_tokenizer):
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = TOY_TEMPLATE
    return tokenizer


def test_chat_template_choices_accept_yaml_booleans():
    assert [PromptConfig(v).chat_template for v in (True, False, "auto", "TRUE", "no")] == [
        "true",
        "false",
        "auto",
        "true",
        "false",
    ]
    with pytest.raises(ValueError, match="chat_template must be auto, true or false, got 'maybe'"):
        PromptConfig("maybe")
    assert from_dict({"chat_template": True}).chat_template == "true"
    assert from_dict({"chat_template": False}).chat_template == "false"
    assert from_dict({}).chat_template == "auto"
    with pytest.raises(ConfigError, match=r"chat_template: 'yes please' is not one of \['auto', 'true', 'false'\]"):
        from_dict({"chat_template": "yes please"})


def test_prompt_template_must_hold_prompt_and_nothing_else():
    with pytest.raises(ValueError, match=r"prompt_template 'Question:' has no \{prompt\} field"):
        PromptConfig(prompt_template="Question:")
    with pytest.raises(
        ValueError, match=r"has fields \['answer'\] that gppo does not fill; the only field is \{prompt\}"
    ):
        PromptConfig(prompt_template="{prompt} {answer}")
    with pytest.raises(ValueError, match="is not a valid template"):
        PromptConfig(prompt_template="{prompt} {")
    with pytest.raises(ConfigError, match=r"has no \{prompt\} field"):
        from_dict({"prompt_template": "no field"})
    assert PromptConfig(prompt_template="{{x}} {prompt}").prompt_template == "{{x}} {prompt}"


def test_without_a_chat_template_the_default_is_the_text_itself(char_tokenizer):
    builder = PromptBuilder(char_tokenizer)
    assert not builder.uses_chat_template and builder("12+34=") == "12+34="
    custom = PromptBuilder(char_tokenizer, PromptConfig("false", system_prompt="Add.", prompt_template="Q {prompt}"))
    assert custom("1+1=") == "Add.\n\nQ 1+1="
    with pytest.raises(ValueError, match="chat_template=true, but the tokenizer has no chat template"):
        PromptBuilder(char_tokenizer, PromptConfig("true"))


def test_conversations_system_prompt_and_template_rules(toy_chat_tokenizer, char_tokenizer):
    config = PromptConfig(system_prompt="Be brief.", prompt_template="Q: {prompt}")
    builder = PromptBuilder(toy_chat_tokenizer, config)
    assert builder.uses_chat_template  # auto, and the tokenizer has one
    assert builder("2+2?") == "<system>Be brief.|<user>Q: 2+2?|<assistant>"
    talk = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    # the template formats the last user turn only; the system prompt goes first
    assert builder(talk) == "<system>Be brief.|<user>hi|<assistant>hello|<user>Q: 2+2?|<assistant>"
    own_system = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "2+2?"}]
    assert builder(own_system) == "<system>Mine.|<user>Q: 2+2?|<assistant>"  # the data's system message wins
    assert own_system[1]["content"] == "2+2?"  # the data is not modified
    off = PromptBuilder(toy_chat_tokenizer, PromptConfig("false", prompt_template="Q: {prompt}"))
    assert off(own_system) == "Mine.\n\nQ: 2+2?"
    with pytest.raises(ValueError, match="assistant turns needs a chat template"):
        off(talk)
    with pytest.raises(ValueError, match="has no user message"):
        builder([{"role": "system", "content": "x"}])


class BosTokenizer:
    """A tokenizer that adds BOS itself and whose template writes it too, as Llama 3's (test only)."""

    bos_token, bos_token_id, chat_template = "<s>", 0, "{{ '<s>' }}..."

    def __call__(self, text):
        return {"input_ids": [self.bos_token_id] + [ord(c) for c in text.replace("<s>", "\0")]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def test_one_bos_when_the_tokenizer_adds_it_and_the_template_writes_it():
    tokenizer = BosTokenizer()
    text = PromptBuilder(tokenizer)("hi")
    assert text == "[user]hi[assistant]"
    assert tokenizer(text)["input_ids"].count(tokenizer.bos_token_id) == 1
    assert PromptBuilder(tokenizer, PromptConfig("false"))("<s>x") == "<s>x"  # no template: text untouched


def test_smollm2_chat_template_round_trip(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    question = "Tom has 3 bags with 4 apples each. How many apples does he have?"
    prompt_text = f"{question}\n\n{MATH_INSTRUCTION}"  # what the data loader makes of a math question
    builder = PromptBuilder(tokenizer)
    assert builder.uses_chat_template
    prompt = builder(prompt_text)
    # SmolLM2's template adds its default system message when none is given
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n" + prompt_text + "<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = PromptBuilder(tokenizer, PromptConfig(system_prompt="Answer in \\boxed{}."))(prompt_text)
    assert with_system.startswith("<|im_start|>system\nAnswer in \\boxed{}.<|im_end|>\n<|im_start|>user\n")
    for text in (prompt, with_system):
        ids = tokenizer(text)["input_ids"]  # as the engines tokenize prompts
        assert tokenizer.decode(ids) == text
        header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        assert ids[-len(header) :] == header and header[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # one per message, none doubled


def test_trainer_and_eval_build_prompts_with_the_builder(micro_model, toy_chat_tokenizer, tmp_path):
    from gppo.evaluation import evaluate
    from gppo.trainer import Trainer
    from tests.test_evaluation import FIXTURES, StubEngine, quiet

    config = dict(model=str(micro_model), steps=1, eval_size=2, progress=False, threads=1)
    trainer = Trainer(from_dict({**config, "output_dir": str(tmp_path / "a"), "prompt_template": "Q{prompt}"}))
    assert trainer.prompts("1+2=") == "Q1+2="  # the embedded tokenizer has no template: auto leaves it off
    with pytest.raises(ConfigError, match="the tokenizer has no chat template.*model"):
        Trainer(from_dict({**config, "output_dir": str(tmp_path / "b"), "chat_template": True}))

    engine = StubEngine({"$2+3$": ["\\boxed{5}"], "half of one": ["\\boxed{0.5}"], "6 \\cdot 7": ["\\boxed{42}"]})
    chat = PromptBuilder(toy_chat_tokenizer, PromptConfig(system_prompt="S"))
    files = {"aime24": FIXTURES / "aime24.jsonl"}
    (summary,) = evaluate(
        engine, ["aime24"], files, 1, tmp_path / "eval", prompts=chat, progress=False, console=quiet()
    )
    assert summary.avg == 1.0 and len(engine.prompts) == 3
    assert all(p.startswith("<system>S|<user>") and p.endswith("\\boxed{}.|<assistant>") for p in engine.prompts)
    other = PromptBuilder(toy_chat_tokenizer, PromptConfig(system_prompt="T"))
    with pytest.raises(ValueError, match="same sampling and prompt settings"):
        evaluate(engine, ["aime24"], files, 1, tmp_path / "eval", prompts=other, progress=False, console=quiet())


def test_gppo_eval_prompt_flags(micro_model, tmp_path, capsys):
    from gppo.cli import main

    base = [
        "eval",
        "--model",
        str(micro_model),
        "--task",
        "addition",
        "--eval_size",
        "4",
        "-n",
        "2",
        "--max_tokens",
        "4",
        "--device",
        "cpu",
    ]
    assert main(base + ["--chat_template", "maybe"]) == 2
    assert "--chat_template: 'maybe' is not one of ['auto', 'true', 'false']" in capsys.readouterr().err
    assert main(base + ["--prompt_template", "no field"]) == 2
    assert "--prompt_template: 'no field' has no {prompt} field" in capsys.readouterr().err
    assert main(base + ["--chat_template", "true"]) == 2
    assert "the tokenizer has no chat template" in capsys.readouterr().err
    assert main(base + ["--prompt_template", "{prompt}", "--chat_template", "auto"]) == 0


def test_a_chat_template_that_raises_is_an_error_naming_the_fix_before_training(
    micro_model, toy_chat_tokenizer, tmp_path, capsys
):
    """A template that refuses system messages (as Gemma's does) raises from jinja when rendered:
    the builder says which roles it failed on and what to change; `gppo train` stops at load."""
    from gppo.cli import main

    refusing = copy.deepcopy(toy_chat_tokenizer)
    refusing.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}" + TOY_TEMPLATE
    )
    builder = PromptBuilder(refusing, PromptConfig(system_prompt="S"))
    with pytest.raises(
        ValueError,
        match=r"chat template failed on a prompt with roles \['system', 'user'\] "
        r"\(TemplateError: System role not supported\): use --chat_template "
        r"false, leave out --system_prompt",
    ):
        builder("1+2=")
    assert PromptBuilder(refusing, PromptConfig())("1+2=") == "<user>1+2=|<assistant>"

    model_dir = tmp_path / "model"
    import shutil

    shutil.copytree(micro_model, model_dir)
    refusing.save_pretrained(model_dir)
    args = [
        "train",
        "--model",
        str(model_dir),
        "--system_prompt",
        "S",
        "--output_dir",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--eval_size",
        "2",
        "--progress",
        "false",
        "--threads",
        "1",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "gppo train: error: the tokenizer's chat template failed" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused at load, before the first evaluation
