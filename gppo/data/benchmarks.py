"""Evaluation benchmarks: public schemas mapped to `BenchmarkProblem`, with protocol defaults.

No benchmark text ships with gppo. Pass a local file or directory in the benchmark's public
schema (any source `gppo.data.loaders.read_rows` reads: .jsonl/.json/.parquet/.csv or a
`save_to_disk` directory), or ask for the Hugging Face hub copy (`from_hub=True`, when reachable).
Columns read (first present wins); math answers go through `reference_answer` (the text after
"####" or in the last \\boxed{} when there is one):

- aime24 (HuggingFaceH4/aime_2024): `problem`, `answer`, `id`.
- aime25 (math-ai/aime25): `problem`, `answer`, `id`.
- amc23 (math-ai/amc23): `question`, `answer` (may be a float such as 27.0), `id`.
- math500 (HuggingFaceH4/MATH-500): `problem`, `answer`, `unique_id`; `subject`, `level` kept.
- gsm8k (openai/gsm8k, config `main`): `question`, `answer` (the worked solution, whose last line
  is "#### N"). Protocol (lm-evaluation-harness's): greedy decoding (n 1, temperature 0), at most
  256 new tokens (the harness's default generation length); pass `n` and a temperature for avg@n.
  Scored twice: strict (the answer in a \\boxed{}, after "the answer is" or after "####") and
  flexible (the last number in the completion, the harness's `flexible-extract`).
- minerva (math-ai/minervamath): `question`, `answer`.
- olympiadbench (math-ai/olympiadbench: `question`, `answer`; or Hothan/OlympiadBench:
  `question`, `final_answer` (a list, joined with ", "), `id`).
- livecodebench (livecodebench/code_generation_lite): `question_id`, `question_title`,
  `question_content`, `starter_code`, `platform`, `difficulty`, `contest_date`,
  `public_test_cases` and `private_test_cases` (JSON lists of {input, output, testtype
  "stdin"|"functional"}; private ones may be base64(zlib(pickle(JSON text)))), `metadata` (JSON
  with `func_name` for functional tests). The hub copy needs a loading script that recent
  `datasets` refuse: download the test*.jsonl files and pass one.
- codeforces (open-r1/codeforces): `id`, `title`, `description`, `input_format`,
  `output_format`, `note`, `examples` and `official_tests` (lists of {input, output}),
  `time_limit`, `memory_limit`, `rating`, `interaction_format`, `input_mode`,
  `generated_checker`. Interactive and file-input problems are rejected; problems with a checker
  (several valid outputs) are kept but judged by output comparison, which can reject valid output.
- humanevalplus (evalplus/humanevalplus): `task_id`, `prompt`, `entry_point`, `test`
  (a `check(candidate)` function, run as an assert test).

Protocol defaults (the field's for reasoning models, e.g. DeepSeek-R1's): temperature 0.6, top-p
0.95, 32768 new tokens (gsm8k: see above), math prompts ending in the `\\boxed{}` instruction,
code prompts asking for one ```python block; n samples per problem as listed in `BENCHMARKS`.
32768 tokens is the norm for long-reasoning models and takes hours per problem on a CPU; a small
model usually stops far earlier, and `--max_tokens` sets a lower cap. Only GSM8K has a flexible
extraction: the field scores the other math benchmarks by the \\boxed{} answer alone.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gppo.core import closest
from gppo.data.loaders import MATH_INSTRUCTION, DataRecord, LoadResult, get_field, map_rows, read_rows, reference_answer
from gppo.rewards.code import AssertTest, io_tests
from gppo.rewards.math import check_golds

BenchmarkProblem = DataRecord  # benchmarks and training data share one record type

STDIN_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and writes "
    "the answer to standard output. Put the whole program in one ```python code block."
)
STARTER_INSTRUCTION = "Complete this starter code and put the whole solution in one ```python code block:"


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark: where its public copy lives, how a row maps, protocol defaults."""

    name: str
    kind: str  # "math" or "code"
    hub_id: str
    hub_split: str
    to_problem: Callable[[dict, int], DataRecord]
    n: int  # samples per problem
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 32768
    hub_config: str | None = None
    flexible: bool = False  # also score the last number in the completion (GSM8K's flexible-extract)


def _math(problem_fields: tuple[str, ...], answer_fields: tuple[str, ...], keep: tuple[str, ...] = ()):
    def to_problem(row: dict, i: int) -> DataRecord:
        problem = get_field(row, *problem_fields)
        answer = reference_answer(get_field(row, *answer_fields), answer_fields[0])
        problem_id = next((str(row[k]) for k in ("id", "unique_id", "ID") if row.get(k) is not None), str(i))
        return DataRecord(
            problem_id,
            f"{problem}\n\n{MATH_INSTRUCTION}",
            "math",
            answer=answer,
            metadata={k: row[k] for k in keep if k in row},
        )

    return to_problem


def _livecodebench(row: dict, i: int) -> DataRecord:
    metadata = _json(row.get("metadata") or "{}", "metadata")
    cases = _pairs(_json(get_field(row, "public_test_cases"), "public_test_cases"), "public_test_cases")
    cases += _pairs(_private_cases(row.get("private_test_cases") or "[]"), "private_test_cases")
    functional = any(c.get("testtype") == "functional" for c in cases)
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    if functional and not fn_name:
        raise ValueError("functional tests need 'func_name' in the 'metadata' JSON")
    inputs, outputs = [c["input"] for c in cases], [c["output"] for c in cases]
    tests = io_tests(inputs, outputs, fn_name if functional else None)
    starter = row.get("starter_code") or ""
    question = get_field(row, "question_content")
    prompt = (
        f"{question}\n\n{STARTER_INSTRUCTION}\n```python\n{starter}\n```"
        if starter
        else f"{question}\n\n{STDIN_INSTRUCTION}"
    )
    keep = {k: row[k] for k in ("question_title", "platform", "difficulty", "contest_date") if k in row}
    return DataRecord(str(get_field(row, "question_id")), prompt, "code", tests=tests, metadata=keep)


def _pairs(cases, name: str) -> list[dict]:
    """`cases` if it is a list of objects with 'input' and 'output'."""
    if not isinstance(cases, list) or not all(isinstance(c, dict) and {"input", "output"} <= c.keys() for c in cases):
        raise ValueError(f"{name!r} must be a list of objects with 'input' and 'output'")
    return cases


def _json(value, name: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"field {name!r} is not valid JSON: {e}") from None


class _TextOnly(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused."""

    def find_class(self, module, name):
        raise ValueError(f"private_test_cases: refusing to unpickle {module}.{name}")


def _private_cases(value) -> list:
    if not isinstance(value, str) or value.lstrip().startswith("["):
        return _json(value, "private_test_cases")
    try:
        text = _TextOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
    except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"field 'private_test_cases' is neither JSON nor base64(zlib(pickle)): {e}") from None
    return _json(text, "private_test_cases")


def _codeforces(row: dict, i: int) -> DataRecord:
    if row.get("interaction_format"):
        raise ValueError("interactive problems are not supported")
    if row.get("input_mode") not in (None, "stdio"):
        raise ValueError(f"input_mode {row['input_mode']!r} is not supported (only 'stdio')")
    cases = _pairs(row.get("official_tests") or row.get("examples") or [], "official_tests")
    if not cases:
        raise ValueError("no tests: both 'official_tests' and 'examples' are empty")
    tests = io_tests([c["input"] for c in cases], [c["output"] for c in cases])
    parts = [get_field(row, "title"), get_field(row, "description")]
    for heading, name in (("Input", "input_format"), ("Output", "output_format")):
        if row.get(name):
            parts.append(f"{heading}\n{row[name]}")
    for example in _pairs(row.get("examples") or [], "examples"):
        parts.append(f"Example input\n{example['input']}\nExample output\n{example['output']}")
    if row.get("note"):
        parts.append(f"Note\n{row['note']}")
    parts.append(STDIN_INSTRUCTION)
    keep = {k: row[k] for k in ("time_limit", "memory_limit", "rating", "tags") if k in row}
    keep["checker"] = bool(row.get("generated_checker"))
    prompt = "\n\n".join(str(p) for p in parts)
    return DataRecord(str(get_field(row, "id")), prompt, "code", tests=tests, metadata=keep)


def _humanevalplus(row: dict, i: int) -> DataRecord:
    prompt, entry, test = get_field(row, "prompt"), get_field(row, "entry_point"), get_field(row, "test")
    text = (
        "Complete the following Python function. Put the whole function, with its imports and "
        f"signature, in one ```python code block.\n```python\n{prompt}```"
    )
    return DataRecord(str(get_field(row, "task_id")), text, "code", tests=[AssertTest(f"{test}\n\ncheck({entry})\n")])


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "math", "HuggingFaceH4/aime_2024", "train", _math(("problem",), ("answer",)), n=32),
        Benchmark("aime25", "math", "math-ai/aime25", "test", _math(("problem",), ("answer",)), n=32),
        Benchmark("amc23", "math", "math-ai/amc23", "test", _math(("question", "problem"), ("answer",)), n=32),
        Benchmark(
            "math500",
            "math",
            "HuggingFaceH4/MATH-500",
            "test",
            _math(("problem",), ("answer",), keep=("subject", "level")),
            n=4,
        ),
        Benchmark(
            "gsm8k",
            "math",
            "openai/gsm8k",
            "test",
            _math(("question",), ("answer",)),
            n=1,
            temperature=0.0,
            top_p=1.0,
            max_tokens=256,
            hub_config="main",
            flexible=True,
        ),
        Benchmark("minerva", "math", "math-ai/minervamath", "test", _math(("question", "problem"), ("answer",)), n=4),
        Benchmark(
            "olympiadbench",
            "math",
            "math-ai/olympiadbench",
            "test",
            _math(("question", "problem"), ("answer", "final_answer")),
            n=4,
        ),
        Benchmark("livecodebench", "code", "livecodebench/code_generation_lite", "test", _livecodebench, n=8),
        Benchmark("codeforces", "code", "open-r1/codeforces", "test", _codeforces, n=8),
        Benchmark("humanevalplus", "code", "evalplus/humanevalplus", "test", _humanevalplus, n=4),
    )
}


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark `name` (case-insensitive); a typo names the closest match."""
    key = name.lower()
    if key not in BENCHMARKS:
        raise ValueError(
            f"unknown benchmark {name!r}{closest(key, BENCHMARKS)}; known benchmarks: {', '.join(BENCHMARKS)}"
        )
    return BENCHMARKS[key]


def load_benchmark(
    name: str,
    data_file: str | Path | None = None,
    from_hub: bool = False,
    validate: bool = True,
    limit: int | None = None,
) -> LoadResult:
    """Problems of a benchmark from `data_file`, or from the hub when `from_hub` is set.

    Rows that do not map (missing field, wrong test schema, duplicate id, and with `validate` a
    math answer math-verify cannot read) are returned as errors; the other rows still load.
    """
    bench = get_benchmark(name)
    if data_file is not None:
        rows = read_rows(data_file)
    elif from_hub:
        rows = read_rows(bench.hub_id, from_hub=True, split=bench.hub_split, config=bench.hub_config)
    else:
        raise ValueError(
            f"no data for benchmark {bench.name!r}: give a local file in {bench.hub_id}'s schema "
            f"(gppo eval --data FILE; in Python data_files={{{bench.name!r}: FILE}}) or load "
            f"{bench.hub_id} from the Hub (--from_hub; in Python from_hub=True)"
        )
    check = _check_answers if validate and bench.kind == "math" else None
    records, errors = map_rows(bench.name, rows[:limit], bench.to_problem, check)
    return LoadResult(records, errors, bench.name)


def _check_answers(records: list[DataRecord]) -> list[str | None]:
    return [p and f"bad answer: {p}" for p in check_golds([r.answer for r in records])]
