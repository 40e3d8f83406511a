"""The embedded default: a character tokenizer and a ~0.5M-parameter Qwen2 model, plus a loader
for any Hugging Face causal-LM folder.

Pitfall handled here: `AutoTokenizer.from_pretrained` on a folder whose `config.json` says
`model_type=qwen2` silently returns a Qwen2 BPE tokenizer for our character vocabulary (it drops
spaces and changes ids). Our tokenizer folders carry `"gppo_char_tokenizer": true` in
`tokenizer_config.json` and are reloaded as `PreTrainedTokenizerFast`; every other folder goes
through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*/()=<>., :?!\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
MARKER = "gppo_char_tokenizer"  # key in tokenizer_config.json that marks our tokenizer folders


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (digits, operators, space, lowercase letters, a little
    punctuation); `<pad>`, `<eos>` and `<unk>` specials; no BOS; left padding for generation."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
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


def load_tokenizer(path: str | Path):
    """Load the tokenizer of a model folder, ready for batched generation.

    Raises if it has no EOS token. Without a pad token, EOS doubles as pad (the usual TRL
    practice; padded positions are masked out, so the choice does not change any result).
    """
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    ours = config_file.exists() and json.loads(config_file.read_text()).get(MARKER, False)
    tokenizer = (PreTrainedTokenizerFast if ours else AutoTokenizer).from_pretrained(str(path))
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {path} has no EOS token, so generation could never stop: set "
            "`eos_token` in its tokenizer_config.json (or special_tokens_map.json)"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_and_tokenizer(path: str | Path, dtype: torch.dtype | str | None = None):
    """Load any Hugging Face causal-LM folder (ours or not) as (model, tokenizer), model in eval mode."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model folder {str(path)!r} does not exist; pass a local folder saved with "
            "save_pretrained, or run `gppo train` without --model to use the embedded default"
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json, so it is not a Hugging Face model folder; "
            "point --model at the folder that save_pretrained wrote"
        )
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto")
    return model.eval(), tokenizer
