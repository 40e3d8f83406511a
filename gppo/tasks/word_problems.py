"""Arithmetic word problems in plain English, answered with a number, for real instruct models.

`"Mia has 7 pencils and buys 5 more. How many pencils does Mia have now? ..."` -> `"12"`.

One operation per problem (add, take away, equal groups, share equally), with small operands, so
that a 100M-parameter instruct model solves some of them at the start of RL and none by accident
of format alone. The completion is scored with the math reward's extraction rules (the last
`\\boxed{}`, else "the answer is X" / "#### X") and an exact integer comparison: reward 1 iff
the extracted answer is the integer answer.
"""

from __future__ import annotations

import random
import re

from gppo.problem import Problem
from gppo.rewards.math import extract_answer

NAMES = ("Tom", "Mia", "Ali", "Sara", "Ben", "Lena", "Omar", "Yuki", "Ravi", "Anna")
ITEMS = ("apples", "books", "marbles", "pencils", "cookies", "stickers", "cards", "shells")
INSTRUCTION = "Put the final answer in \\boxed{}."
_INTEGER = re.compile(r"-?\d+")


class WordProblemTask:
    """One-step word problems; operands up to `max_operand` (products and quotients up to
    `max_operand` x 10). `operations` picks from add, subtract, multiply, divide."""

    name = "word-problems"
    embedded_model = False  # English text: beyond the embedded model's character vocabulary

    def __init__(self, max_operand: int = 20, operations: tuple[str, ...] = ("add", "subtract", "multiply", "divide")):
        unknown = set(operations) - set(_TEMPLATES)
        if not operations or unknown:
            raise ValueError(f"operations must be a non-empty subset of {sorted(_TEMPLATES)}, got {operations}")
        if max_operand < 2:
            raise ValueError(f"max_operand must be >= 2, got {max_operand}")
        self.max_operand, self.operations = max_operand, tuple(operations)

    def sample(self, rng: random.Random) -> Problem:
        operation = rng.choice(self.operations)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, self.max_operand), rng.randint(2, min(self.max_operand, 10))
        text, answer = _TEMPLATES[operation](name, item, a, b)
        return Problem(f"{text} {INSTRUCTION}", str(answer), {"operation": operation})

    def score(self, problem: Problem, completion: str) -> float:
        answer = extract_answer(completion)
        match = _INTEGER.fullmatch(answer.replace(",", "").strip()) if answer else None
        return float(match is not None and int(match.group()) == int(problem.answer))

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        return f"The answer is \\boxed{{{problem.answer}}}."


def _add(name, item, a, b):
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b


def _subtract(name, item, a, b):
    return f"{name} has {a + b} {item} and gives away {b}. How many {item} does {name} have left?", a


def _multiply(name, item, a, b):
    return f"{name} has {b} boxes with {a} {item} in each box. How many {item} does {name} have?", a * b


def _divide(name, item, a, b):
    return (f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?", a)


_TEMPLATES = {"add": _add, "subtract": _subtract, "multiply": _multiply, "divide": _divide}
