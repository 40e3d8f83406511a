"""Math answer rewards: extract the final answer, compare it to the reference with math-verify.

Extraction (`extract_answer`) searches only the text after the last `</think>` when there is one:

1. the last complete `\\boxed{...}` or `\\fbox{...}` (nested braces allowed; with several boxes
   only the last counts);
2. otherwise the last "the answer is X", "final answer is X", "Answer: X" or "#### X", up to the
   end of its line (surrounding `$`, `\\(...\\)`, `**` and a final period are removed);
3. otherwise nothing: the verdict is `unparsable`.

Equivalence is math-verify's `parse` + `verify` (gold first; verify is not symmetric), with both
sides in `$...$` so math-verify reads them as LaTeX: a bare gold such as `\\frac{1}{\\sqrt{2}}`
otherwise parses to nothing.

Hedges score 0 (verdict `hedged`). math-verify keeps one side of many hedged forms (`4 = 3` is
read as 3, `3 \\lor 4` and `3 \\\\ 4` as 4, `x \\approx 3` as 3), so an answer offering two values
would score 1 against either. When the gold is a single value (a number or expression, or
`x = value` with a bare variable on the left), the answer is a hedge if it is

- a relation other than `=` (one table, `_RELATION_COMMANDS` and `_RELATION_SYMBOLS`): `<`, `\\le`,
  `\\ne`, `\\not`, `\\approx`, `\\equiv`, `\\mid` (`3 \\mid 4`), `\\in`, `\\subset`, `\\parallel`,
  `\\perp`, ..., or a bar without its pair (`3 | 4`; `|x|` is an absolute value);
- a disjunction: `\\lor`, `\\vee`, `\\pm`, the word "or" ("3 or 4", "3 (or 4)");
- a case split: `\\begin{cases}`, the words "if", "otherwise", "else", "unless", "when";
- several lines: `\\\\`, `\\newline`;
- a list, tuple, set of several values, interval or matrix (as math-verify parses it);
- an equation with a side that is a number other than the gold: `4 = 3` scores 0, while
  `x = 3`, `f(2) = 3`, `2 \\cdot 3 = 6` and `3 = 3` keep math-verify's verdict. The rule: every
  side of the `=` chain is either equal to the gold or not a closed number (a name such as `x`).

A form the gold itself has (a gold `\\text{black or white}`) is not a hedge. Golds that are sets,
tuples, intervals, lists or relations (`(1, 2)`, `\\{1,2\\}`, `[0, 1)`, `x \\le 3`) are left
entirely to math-verify. These rules only ever take credit away from math-verify's verdict.

math-verify bounds its own run time with `signal.alarm`, which fails outside the main thread, so
its timeouts are disabled and every comparison runs in a small pool of persistent worker
processes instead: a worker that misses the deadline is killed and restarted, and the verdict is
`timeout`. This works from any thread.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum


class MathVerdict(str, Enum):
    """How an answer compares with the gold answer; `reward` maps it to 1 or 0."""

    CORRECT = "correct"
    WRONG = "wrong"
    UNPARSABLE = "unparsable"  # no answer found, or math-verify could not read it
    HEDGED = "hedged"  # a relation, disjunction, case split, several lines or a list (module docstring)
    TIMEOUT = "timeout"

    @property
    def reward(self) -> float:
        """1 for a correct answer, 0 otherwise."""
        return 1.0 if self is MathVerdict.CORRECT else 0.0


@dataclass(frozen=True)
class MathResult:
    """The verdict on one completion, the answer extracted from it, and `error`: a data error, or
    why a hedged answer scores 0."""

    verdict: MathVerdict
    answer: str | None
    error: str | None = None

    @property
    def reward(self) -> float:
        """The verdict's reward."""
        return self.verdict.reward


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANCHOR = re.compile(
    r"(?:(?:final answer|the answer) is|^[ \t*]*answer[ \t*]*:|####)[ \t:*]*(.+)$", re.IGNORECASE | re.MULTILINE
)


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion (see the module docstring for the rules), or None."""
    text = completion.rsplit("</think>", 1)[-1]
    boxed = _last_box(text)
    if boxed is not None:
        return boxed.strip()
    anchored = _ANCHOR.findall(text)
    if not anchored:
        return None
    answer = anchored[-1].strip().rstrip(".").strip()
    for left, right in (("**", "**"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left) + len(right):
            answer = answer[len(left) : -len(right)].strip()
    return answer or None


def _last_box(text: str) -> str | None:
    """The contents of the last complete box, in one pass over the braces (degenerate outputs
    repeating an unclosed `\\boxed{` thousands of times stay linear)."""
    box_starts = {m.end() for m in _BOX.finditer(text)}  # just after each box's "{"
    if not box_starts:
        return None
    open_at: list[int] = []
    last: tuple[int, int] | None = None
    for brace in re.finditer(r"[{}]", text):
        if brace.group() == "{":
            open_at.append(brace.end())
        elif open_at:
            start = open_at.pop()
            if start in box_starts and (last is None or start > last[0]):
                last = (start, brace.start())
    return None if last is None else text[last[0] : last[1]]


# Relations other than `=`, the one table of them: an answer stating one (`3 \\mid 4`, `x \\le 3`)
# relates values rather than giving one, and math-verify keeps one of its sides.
_RELATION_COMMANDS = (
    "lt",
    "gt",
    "le",
    "leq",
    "leqq",
    "leqslant",
    "ge",
    "geq",
    "geqq",
    "geqslant",
    "ll",
    "gg",
    "lesssim",
    "gtrsim",
    "lessgtr",
    "gtrless",
    "nless",
    "ngtr",
    "nleq",
    "ngeq",
    "prec",
    "preceq",
    "succ",
    "succeq",  # order
    "ne",
    "neq",
    "not",
    "approx",
    "approxeq",
    "simeq",
    "sim",
    "nsim",
    "cong",
    "ncong",
    "doteq",
    "equiv",
    "asymp",
    "propto",  # (in)equality up to something
    "mid",
    "nmid",
    "shortmid",
    "nshortmid",  # divisibility
    "in",
    "notin",
    "ni",
    "owns",
    "subset",
    "subseteq",
    "subsetneq",
    "nsubseteq",
    "supset",
    "supseteq",
    "supsetneq",
    "nsupseteq",
    "sqsubset",
    "sqsubseteq",
    "sqsupset",
    "sqsupseteq",  # sets
    "parallel",
    "nparallel",
    "perp",  # geometry
)
_RELATION_SYMBOLS = "<>≤≥≦≧⩽⩾≪≫≺≻≠≈≃∼≅≡≍∝∣∤∈∉∋⊂⊆⊊⊄⊈⊃⊇⊋⊅⊉∥∦⊥"
# A command must not run on into letters: `\\le` is not `\\left`, `\\in` is not `\\infty`.
_RELATION = re.compile(f"[{re.escape(_RELATION_SYMBOLS)}]|\\\\(?:{'|'.join(_RELATION_COMMANDS)})(?![A-Za-z])")
_SIZED_BAR = re.compile(r"\\(?:left|right|middle|[bB]igg?[lrm]?)\s*\||\\\|")  # \left| ... \right|, a norm \|


def _relation(text: str) -> str | None:
    """The first relation of the table in `text`, or "|" for an unpaired bar (`3 | 4` divides;
    bars in pairs are absolute values)."""
    found = _RELATION.search(text)
    if found:
        return found.group()
    return "|" if _SIZED_BAR.sub("", text).count("|") % 2 else None


def _search(pattern: re.Pattern):
    """A finder: the text of the pattern's first match in a text, or None."""
    return lambda text: (found := pattern.search(text)) and found.group()


# Hedged forms found in the answer's text, because math-verify's parse drops them (module docstring).
_HEDGE_FORMS = (
    ("a case split", _search(re.compile(r"\\begin\{cases\}|\b(?:if|otherwise|else)\b", re.IGNORECASE))),
    ("a disjunction", _search(re.compile(r"\\(?:lor|vee|pm|mp)(?![A-Za-z])|\bor\b|[±∓∨]", re.IGNORECASE))),
    ("a relation", _relation),
    ("several lines", _search(re.compile(r"\\\\|\\newline(?![A-Za-z])"))),
)


def hedge_form(answer: str, gold: str = "") -> str | None:
    """The hedged form in an answer's LaTeX (a case split, a disjunction, a relation other than `=`,
    several lines) that the gold's LaTeX does not have, as "a relation (\\approx)"; else None."""
    answer = re.sub(r"(?:\\\\|\s)+$", "", answer)  # a trailing line break is layout
    for name, find in _HEDGE_FORMS:
        found = find(answer)
        if found and not find(gold):
            return f"{name} ({found})"
    return None


def equation_sides(answer: str) -> list[str]:
    """The sides of an `=` chain outside braces, brackets and parentheses (one side: no equation)."""
    sides, depth, start = [], 0, 0
    for i, char in enumerate(answer):
        if char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        elif char == "=" and depth == 0:
            sides.append(answer[start:i].strip())
            start = i + 1
    return sides + [answer[start:].strip()]


def _latex_body(text: str) -> str:
    """The LaTeX inside a math-verify-ready string (`$...$` or `\\boxed{...}`)."""
    if "\\boxed" in text or "\\fbox" in text:
        return _last_box(text) or text
    return text.strip().strip("$").strip()


def normalize_gold(answer: object) -> str:
    """A gold answer as math-verify parses it: in `$...$` unless already boxed or in `$`."""
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer).strip()
    if not text:
        raise ValueError("the gold answer is empty")
    if "\\boxed" in text or text.startswith("$"):
        return text
    return f"${text}$"


def score_math(completions: Sequence[str], golds: Sequence[object], timeout_s: float = 5.0) -> list[MathResult]:
    """Verdicts for each completion against its gold answer, in a shared `MathScorer` pool of
    min(4, CPU count) worker processes started on first use."""
    return _default_scorer().score(completions, golds, timeout_s)


_PLAIN_NUMBER = re.compile(r"-?(?:\d+|\d{1,3}(?:,\d{3})+)(?:\.\d+)?")  # 12, -0.5, 2,400


def check_golds(golds: Sequence[object], timeout_s: float = 5.0) -> list[str | None]:
    """For each gold answer, None if math-verify reads it (and finds it equal to itself), else what
    is wrong with it. Plain numbers need no worker and equal texts are judged once, so a data set
    of mostly integer answers is checked in seconds."""
    errors: list[str | None] = [None] * len(golds)
    texts: dict[str, list[int]] = {}  # gold text -> the indices holding it
    for i, gold in enumerate(golds):
        try:
            text = normalize_gold(gold)
        except ValueError as e:
            errors[i] = str(e)
            continue
        if not _PLAIN_NUMBER.fullmatch(text.strip("$")):
            texts.setdefault(text, []).append(i)
    results = _default_scorer().judge([(text, text) for text in texts], timeout_s)
    for indices, r in zip(texts.values(), results):
        if r.verdict is not MathVerdict.CORRECT:
            for i in indices:
                errors[i] = r.error or (
                    f"math-verify does not find the gold answer {golds[i]!r} equal to itself ({r.verdict.value})"
                )
    return errors


class MathScorer:
    """A pool of `workers` math-verify processes, started on first use and restarted on timeout."""

    def __init__(self, workers: int | None = None):
        count = workers or min(4, os.cpu_count() or 1)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(count):
            self._idle.put(_Worker())
        self._count = count

    def score(self, completions: Sequence[str], golds: Sequence[object], timeout_s: float = 5.0) -> list[MathResult]:
        """Extract each completion's answer and compare it with its gold answer."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        results: list[MathResult] = []
        todo: list[tuple[int, str, str]] = []  # (index, gold, answer)
        for i, (completion, gold) in enumerate(zip(completions, golds)):
            answer = extract_answer(completion)
            try:
                gold_text = normalize_gold(gold)
            except ValueError as e:
                results.append(MathResult(MathVerdict.UNPARSABLE, answer, str(e)))
                continue
            results.append(MathResult(MathVerdict.UNPARSABLE, answer))
            if answer is not None:
                todo.append((i, gold_text, answer))
        judged = self.judge([(gold, f"${answer}$") for _, gold, answer in todo], timeout_s)
        for (i, _, answer), r in zip(todo, judged):
            results[i] = MathResult(r.verdict, answer, r.error)
        return results

    def judge(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[MathResult]:
        """Verdicts for (gold, answer) pairs of math-verify-ready strings."""
        if not pairs:
            return []

        def one(pair: tuple[str, str]) -> MathResult:
            worker = self._idle.get()
            try:
                return worker.ask(pair, timeout_s)
            finally:
                self._idle.put(worker)

        with ThreadPoolExecutor(max_workers=min(self._count, len(pairs))) as pool:
            return list(pool.map(one, pairs))

    def close(self) -> None:
        """Stop the worker processes (they restart on the next call)."""
        for _ in range(self._count):
            worker = self._idle.get()
            worker.close()
            self._idle.put(worker)


_DEFAULT: MathScorer | None = None
_DEFAULT_LOCK = threading.Lock()


def _default_scorer() -> MathScorer:
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathScorer()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


# Loads this file under a private name, so the worker imports neither `gppo` (and torch) nor a
# stdlib-shadowing `math` module; it sees the same sys.path as the caller.
_WORKER_BOOT = (
    "import sys, json, importlib.util as u; sys.path[:] = json.loads(sys.argv[1]); "
    "s = u.spec_from_file_location('_gppo_math_worker', sys.argv[2]); "
    "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); m._serve()"
)
_STARTUP_TIMEOUT_S = 120.0


class _Worker:
    """One math-verify process answering one JSON request per line."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def ask(self, pair: tuple[str, str], timeout_s: float) -> MathResult:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            self._proc.stdin.write(json.dumps(pair).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._read_line(time.monotonic() + timeout_s)
        except (EOFError, BrokenPipeError):
            self.close()
            return MathResult(MathVerdict.UNPARSABLE, pair[1], "the math-verify worker crashed")
        if line is None:
            self.close()
            return MathResult(MathVerdict.TIMEOUT, pair[1])
        reply = json.loads(line)
        return MathResult(MathVerdict(reply["verdict"]), pair[1], reply.get("error"))

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, json.dumps(sys.path), os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buffer = b""
        try:
            ready = self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S)
        except EOFError:
            ready = None
        if ready != b"ready":
            self.close()
            raise RuntimeError(
                "the math-verify worker did not start (its error is on stderr); check "
                "that `import math_verify` works here (pip install math-verify)"
            )

    def _read_line(self, deadline: float) -> bytes | None:
        """The next reply line, None at the deadline; EOFError if the worker died."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None


def _serve() -> None:
    """Worker loop: a JSON [gold, answer] per stdin line -> a JSON verdict per line."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints from the libraries must not corrupt the replies
    import math_verify  # noqa: F401 - fails here, before "ready", when it is missing

    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        replies.write(json.dumps(_judge(*json.loads(line))) + "\n")
        replies.flush()


def _judge(gold: str, answer: str) -> dict:
    """The verdict on a (gold, answer) pair of math-verify-ready strings (runs in a worker)."""
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=None)
    if not gold_parsed:
        return {"verdict": "unparsable", "error": f"math-verify cannot parse the gold answer {gold!r}"}
    answer_parsed = parse(answer, parsing_timeout=None)
    if not answer_parsed:
        return {"verdict": "unparsable"}
    if _is_single_value(gold_parsed[0]):
        hedge = _hedge(gold_parsed, _latex_body(gold), answer_parsed[0], _latex_body(answer))
        if hedge:
            return {"verdict": "hedged", "error": f"hedge where one value is expected: {hedge}"}
    correct = verify(gold_parsed, answer_parsed, timeout_seconds=None)
    return {"verdict": "correct" if correct else "wrong"}


def _is_single_value(value) -> bool:
    """A number or expression (or text), `x = value` with a bare variable, or a one-element set."""
    import sympy

    if isinstance(value, sympy.Equality):
        return isinstance(value.lhs, sympy.Symbol) and isinstance(value.rhs, sympy.Expr)
    if isinstance(value, sympy.FiniteSet):
        return len(value) == 1
    return isinstance(value, (str, sympy.Expr))


def _hedge(gold_parsed: list, gold: str, answer_value, answer: str) -> str | None:
    """Why an answer hedges against a single-value gold (module docstring), or None."""
    import sympy
    from math_verify import parse, verify

    form = hedge_form(answer, gold)
    if form:
        return form
    sides = equation_sides(answer)
    is_relation = isinstance(answer_value, sympy.logic.boolalg.Boolean)  # `=` chains: judged by side
    if not (len(sides) > 1 and is_relation) and not _is_single_value(answer_value):
        return _shape(answer_value)
    for side in sides if len(sides) > 1 else ():
        parsed = parse(f"${side}$", parsing_timeout=None)
        if not parsed or verify(gold_parsed, parsed, timeout_seconds=None):
            continue
        value = parsed[0]
        if isinstance(value, str) or (isinstance(value, sympy.Expr) and not value.is_number):
            continue  # a name such as x or f(2)
        return f"an equation with a side ({side}) that is not the gold answer"
    return None


def _shape(value) -> str:
    """What a parsed answer of several values is, in words."""
    import sympy

    for kind, name in (
        (sympy.Set, "a set or interval of values"),
        (sympy.MatrixBase, "a matrix"),
        (sympy.logic.boolalg.Boolean, "a relation or logical formula"),
    ):
        if isinstance(value, kind):
            return name
    return "a tuple or list of values"
