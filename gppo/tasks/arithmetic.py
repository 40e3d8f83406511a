"""Reversed addition: `"123+456="` -> `"9750"` (the sum 0579, padded to digits+1, written least
significant digit first, so each answer digit depends only on the operands and the carry from
the digit just written)."""

from __future__ import annotations

import random

from gppo.problem import Problem


class AdditionTask:
    """Add two `digits`-digit numbers (zero-padded); every answer has digits+1 characters.

    The imperfect teacher drops each carry with probability `drop_carry` (0.5: a warm start that
    converges to ~0.45 sampled accuracy, leaving RL to learn to always carry).

    `short_operands` > 0 draws each operand, with that probability, with a random number of digits
    (1 to `digits`, zero-padded). With uniform digits the SFT loss sits on a plateau for hundreds
    to thousands of steps depending on the seed: one answer digit tells nothing about one operand
    digit, only about the pair. Short operands put zeros in the prompt, which gives a direct
    signal. The warm start uses 0.5; evaluation and RL use the default 0.
    """

    name = "addition"

    def __init__(self, digits: int = 3, drop_carry: float = 0.5, short_operands: float = 0.0):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if not 0.0 <= drop_carry <= 1.0:
            raise ValueError(f"drop_carry must be in [0, 1], got {drop_carry}")
        if not 0.0 <= short_operands <= 1.0:
            raise ValueError(f"short_operands must be in [0, 1], got {short_operands}")
        self.digits, self.drop_carry, self.short_operands = digits, drop_carry, short_operands

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        prompt = f"{a:0{self.digits}d}+{b:0{self.digits}d}="
        return Problem(prompt, self._reversed_sum(a, b, None), {"a": a, "b": b})

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        return self._reversed_sum(problem.metadata["a"], problem.metadata["b"], rng)

    def _operand(self, rng: random.Random) -> int:
        """Uniform on `digits` digits, or with probability `short_operands` on a random shorter
        length (zero-padded)."""
        length = rng.randint(1, self.digits) if rng.random() < self.short_operands else self.digits
        return rng.randrange(10**length)

    def _reversed_sum(self, a: int, b: int, rng: random.Random | None) -> str:
        """Digit-by-digit sum, least significant first; with `rng`, each carry is dropped with
        probability `drop_carry`."""
        out, carry = [], 0
        for _ in range(self.digits):
            s = a % 10 + b % 10 + carry
            out.append(str(s % 10))
            carry = s // 10
            if carry and rng is not None and rng.random() < self.drop_carry:
                carry = 0
            a, b = a // 10, b // 10
        return "".join(out) + str(carry)
