"""The embedded default: a character tokenizer and a ~0.5M-parameter Qwen2 model.

Its tokenizer folders carry the `MARKER` key so that `gppo.models.loading` reloads them as
`PreTrainedTokenizerFast` (see the pitfall described there). Loading lives in
`gppo.models.loading`.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from gppo.models.loading import MARKER

__all__ = ["CHARS", "MARKER", "SPECIAL_TOKENS", "build_model", "build_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*/()=<>., :?!\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def build_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """One token per character (digits, operators, space, lowercase letters, a little
    punctuation, then `extra_chars`, e.g. a task's backtick); `<pad>`, `<eos>` and `<unk>`
    specials; no BOS; left padding for generation."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + list(extra_chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # (?m): "." matches "\n" too
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        **{MARKER: True},
    )


def build_model(tokenizer, seed: int = 0, hidden: int = 128, layers: int = 2, heads: int = 4):
    """A freshly initialised `Qwen2ForCausalLM` sized for `tokenizer` (0.53M parameters by default)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)
