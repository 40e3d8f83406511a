"""Countdown: reach a target with a few small numbers, e.g. `"2 3 7 -> 27:"` -> `"3*7+2*3"`.

Rules of the verifier (the completion is parsed with `ast`, never evaluated by Python):
- only non-negative integer literals, `+ - * /` and parentheses (no unary minus, no `**`);
- each given number may be used AT MOST ONCE (as in the TV game; leaving some out is allowed);
- every division must be exact (`7/2` is invalid), evaluated on the parse tree as written;
- reward 1 iff the value equals the target.
Targets are reachable by construction: each problem is built from a random expression tree over
all its numbers, whose intermediate values are positive integers.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter

from gppo.problem import Problem

_ALLOWED = re.compile(r"[0-9+\-*/() ]+")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
MAX_CHARS = 100  # longer completions score 0 without being parsed


class CountdownTask:
    """3 or 4 numbers in 1..`max_number`, target in 1..`max_target`.

    The imperfect teacher writes the construction expression with probability `p_correct`,
    otherwise that expression with one operator replaced (right only by accident), so about a
    third of its answers are correct and lengths vary with the expression.
    """

    name = "countdown"

    def __init__(
        self, counts: tuple[int, ...] = (3, 4), max_number: int = 9, max_target: int = 99, p_correct: float = 0.3
    ):
        if not counts or min(counts) < 2:
            raise ValueError(f"counts must be numbers of operands >= 2, got {counts}")
        if not 0.0 <= p_correct <= 1.0:
            raise ValueError(f"p_correct must be in [0, 1], got {p_correct}")
        self.counts, self.max_number, self.max_target = tuple(counts), max_number, max_target
        self.p_correct = p_correct

    def sample(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(rng.choice(self.counts))]
            target, solution = _random_expression(numbers, rng)
            if 1 <= target <= self.max_target and target not in numbers:
                break
        prompt = f"{' '.join(map(str, sorted(numbers)))} -> {target}:"
        meta = {"numbers": sorted(numbers), "target": target, "solution": solution}
        return Problem(prompt, str(target), meta)

    def score(self, problem: Problem, completion: str) -> float:
        value = evaluate(completion, problem.metadata["numbers"])
        return float(value is not None and value == problem.metadata["target"])

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        solution = problem.metadata["solution"]
        if rng.random() < self.p_correct:
            return solution
        spots = [i for i, c in enumerate(solution) if c in _PREC]
        i = rng.choice(spots)
        return solution[:i] + rng.choice([o for o in _PREC if o != solution[i]]) + solution[i + 1 :]


def evaluate(expression: str, numbers: list[int]) -> int | None:
    """Value of `expression` under the rules above, or None if it breaks any of them."""
    text = expression.strip()
    if len(text) > MAX_CHARS or not _ALLOWED.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used = Counter()
    value = _eval(tree.body, used)
    if value is None or used - Counter(numbers):
        return None
    return value


def _eval(node: ast.AST, used: Counter) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used[node.value] += 1
        return node.value
    if not (isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS):
        return None
    a, b = _eval(node.left, used), _eval(node.right, used)
    if a is None or b is None:
        return None
    op = _AST_OPS[type(node.op)]
    if op == "/":
        return a // b if b != 0 and a % b == 0 else None
    return a + b if op == "+" else a - b if op == "-" else a * b


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """Combine all numbers, two at a time, with random operators whose results are positive
    integers. Returns (value, expression with minimal parentheses)."""
    pool = [(n, str(n), 3) for n in numbers]  # (value, text, precedence; 3 = atom)
    while len(pool) > 1:
        rng.shuffle(pool)
        (a, ta, pa), (b, tb, pb) = pool.pop(), pool.pop()
        if a < b:
            (a, ta, pa), (b, tb, pb) = (b, tb, pb), (a, ta, pa)
        ops = ["+", "*"] + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0)
        op = rng.choice(ops)
        if op in "+*" and rng.random() < 0.5:  # commutative: either order reads naturally
            (a, ta, pa), (b, tb, pb) = (b, tb, pb), (a, ta, pa)
        p = _PREC[op]
        left = f"({ta})" if pa < p else ta
        right = f"({tb})" if pb < p or (pb == p and op in "-/") else tb
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
        pool.append((value, left + op + right, p))
    return pool[0][0], pool[0][1]
