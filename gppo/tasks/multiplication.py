"""Multiplication with a code interpreter: `"347*829="` -> `"287663"`. The product of two 3-digit
numbers is beyond what the embedded model computes in its head. With `--tools python` it can
write a block and read the answer in the interpreter's output (the format: `gppo.tool_format`),
then write it again: `287663` after the output block.

The answer is the text after the last ``` fence of the model's own text: rewards read the
completion with its tool spans cut out (`gppo.rewards.pipeline.model_text`), so the output block
alone does not count, nor an output that imitates an answer.
"""

from __future__ import annotations

import random

from gppo.problem import Problem
from gppo.tool_format import FENCE, output_block


class MultiplicationTask:
    """Multiply two `digits`-digit numbers.

    The imperfect teacher calls the tool with probability `p_tool` and copies its output. Otherwise
    it answers in its head and gets one digit (not the last) wrong. The warm start then calls the
    tool on about half of the problems, and RL has a tool-call rate to raise."""

    name = "multiplication"
    tools = ("python",)  # the tool the task is built for: its warm start writes the block format
    extra_chars = "`"  # beyond the embedded tokenizer's characters: the fences
    # room for a call, its output and the answer (57 tokens with EOS), with or without --tools: the warm
    # start writes the call either way
    defaults = {"max_new_tokens": 64}

    def __init__(self, digits: int = 3, p_tool: float = 0.5):
        if digits < 2:
            raise ValueError(f"digits must be >= 2, got {digits}")
        if not 0.0 <= p_tool <= 1.0:
            raise ValueError(f"p_tool must be in [0, 1], got {p_tool}")
        self.digits, self.p_tool = digits, p_tool

    def sample(self, rng: random.Random) -> Problem:
        a, b = (rng.randrange(10 ** (self.digits - 1), 10**self.digits) for _ in range(2))
        return Problem(f"{a}*{b}=", str(a * b), {"a": a, "b": b})

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.rsplit(FENCE, 1)[-1].strip() == problem.answer)

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        a, b = problem.metadata["a"], problem.metadata["b"]
        if rng.random() < self.p_tool:
            return f"{FENCE}python\nprint({a}*{b})\n{FENCE}\n{output_block(str(a * b))}{a * b}"
        digits = list(str(a * b))
        wrong = rng.randrange(len(digits) - 1)
        digits[wrong] = rng.choice([d for d in "0123456789" if d != digits[wrong] and (wrong or d != "0")])
        return "".join(digits)
