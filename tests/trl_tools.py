"""TRL's tool calling on CPU without downloads, for tests/test_trl_trainer.py and
tests/trl_multiprocess_job.py: a character tokenizer carrying the Qwen3 chat template that TRL ships
(TRL recognises it and adds its tool-call parser), the tiny Qwen2 sized for it, a tool and an
`environment_factory` environment, and `scripted_tool_calls`, which makes the first turn call the
tool whatever the weights (as TRL's own tool tests patch `generate`)."""

from __future__ import annotations

import re
import string
from contextlib import contextmanager
from pathlib import Path

import torch
import trl
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gppo.models.embedded import build_model

TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen3_instruct_2507.jinja"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QUESTIONS = ["3*4?", "12*34?", "7*8?", "25*4?", "9*9?", "123*45?", "6*7?", "2*5?"]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, Qwen's chat and tool tags one token each; EOS is
    <|im_end|> (the end of a turn), padding <|endoftext|>, left padding for generation."""
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *TAGS, *chars, "<unk>"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=TEMPLATE.read_text(),
    )


def save_chat_model(path: Path) -> list[torch.Tensor]:
    """The 1-layer tiny Qwen2 for chat_tokenizer, saved to `path` (positions up to 1024: the tool's
    schema in the system prompt takes about 600 character tokens); returns its parameters."""
    model = build_model(chat_tokenizer(), seed=0, hidden=32, layers=1, heads=2)
    model.config.max_position_embeddings = 1024
    model.save_pretrained(path)
    return [p.detach().clone() for p in model.parameters()]


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def digits(completions, **kwargs) -> list[float]:
    """Reward: the number of digits in the completion's messages (tool results included)."""
    return [float(sum(ch.isdigit() for message in c for ch in str(message["content"]))) for c in completions]


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Calculator:
    """An environment for `environment_factory`: its public methods are the model's tools; it counts
    the calls it served since its last reset."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b


def first_turn(prompt: str, row: int) -> str:
    """The scripted first answer to a prompt ending in "<a>*<b>?": three rows of each group of four
    call multiply(a, b), the fourth answers in words."""
    a, b = re.findall(r"(\d+)\*(\d+)\?", prompt)[-1]
    if row % 4 == 3:
        return "no<|im_end|>"
    return f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'


@contextmanager
def scripted_tool_calls(trainer):
    """Patch `trainer.model.generate` (the model TRL's transformers path generates with) during the
    block: a first turn (no <tool_response> in its input yet) is `first_turn`'s text, so that the tool
    runs whatever the weights; after a tool result the model samples as usual."""
    model, tokenizer = trainer.model, trainer.processing_class
    sample = model.generate
    response = tokenizer.convert_tokens_to_ids("<tool_response>")

    def generate(input_ids, **kwargs):
        if (input_ids == response).any():
            return sample(input_ids=input_ids, **kwargs)
        texts = [first_turn(tokenizer.decode(ids), row) for row, ids in enumerate(input_ids)]
        ids = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
        return torch.cat([input_ids, ids.input_ids.to(input_ids.device)], dim=1)

    model.generate = generate
    try:
        yield
    finally:
        del model.generate
