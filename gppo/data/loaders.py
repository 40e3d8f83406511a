"""Training data from local files: DeepScaleR, DAPO-Math-17k and Skywork-OR1 -> `DataRecord`.

Public schemas (Hugging Face dataset cards), detected from the columns of the first row:

- `deepscaler` (agentica-org/DeepScaleR-Preview-Dataset): `problem`, `answer`, `solution`.
  The prompt is the problem followed by the `\\boxed{}` instruction (the rows carry none).
- `verl` (BytedTsinghua-SIA/DAPO-Math-17k; Skywork/Skywork-OR1-RL-Data, splits `math` and
  `code`): `data_source`, `prompt` (chat messages `[{"role", "content"}]`; the prompt is the last
  user message, which already holds the instructions), `ability` ("MATH", "math" or "code"),
  `reward_model` (`{"ground_truth", "style"}`), `extra_info` (`{"index", ...}`). The math ground
  truth is the answer (DAPO) or a Python-literal list of accepted answers such as "['3']"
  (Skywork; the first is `answer`, and `metadata["answers"]` lists them when there are several).
  The code ground truth is JSON: `{"inputs", "outputs", "fn_name"?}` (stdin/stdout, or calls
  when `fn_name` is set) or `{"assert_case": [code, ...]}`.

Rows that do not fit are reported as `RowError`s; the other rows still load.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gppo.rewards.code import AssertTest, CodeTest, io_tests

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class DataRecord:
    """One problem: a math `answer` or code `tests`, with the prompt to send to the model."""

    id: str
    prompt: str
    kind: str  # "math" or "code"
    answer: str | None = None
    tests: list[CodeTest] | None = None
    metadata: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class RowError:
    """Why one row of a data source was skipped."""

    source: str
    row: int
    message: str
    id: str | None = None

    def __str__(self) -> str:
        where = f"{self.source} row {self.row}" + (f" (id {self.id!r})" if self.id else "")
        return f"{where}: {self.message}"


@dataclass
class LoadResult:
    """The records that loaded, the rows that did not, and the schema (or benchmark) name."""

    records: list[DataRecord]
    errors: list[RowError]
    schema: str


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl, .json (a list of objects, or JSON lines) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet  # installed with `datasets`; imported only when needed (slow)

        return pyarrow.parquet.read_table(path).to_pylist()
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"unsupported data file type {suffix!r} ({path}): use .jsonl, .json or .parquet")
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {number} is not valid JSON: {e}") from None
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad:
        raise ValueError(f"{path}: row {bad[0]} is a {type(rows[bad[0]]).__name__}, not a JSON object")
    return rows


def get_field(row: dict, *names: str):
    """The value of the first of `names` present in `row`; a clear error if none is."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    wanted = " or ".join(repr(n) for n in names)
    raise ValueError(f"missing field {wanted} (columns seen: {', '.join(sorted(row))})")


def map_rows(source: str, rows: list[dict], to_record: Callable[[dict, int], DataRecord],
             check: Callable[[list[DataRecord]], list[str | None]] | None = None,
             ) -> tuple[list[DataRecord], list[RowError]]:
    """Apply `to_record` to each row, collecting per-row errors (later duplicate ids are errors);
    `check` may then reject records by returning an error message for them."""
    mapped: list[tuple[int, DataRecord]] = []
    errors, seen = [], set()
    for i, row in enumerate(rows):
        try:
            record = to_record(row, i)
        except (ValueError, TypeError) as e:
            errors.append(RowError(source, i, str(e), _row_id(row)))
            continue
        if record.id in seen:
            errors.append(RowError(source, i, "duplicate id: the earlier row is kept", record.id))
            continue
        seen.add(record.id)
        mapped.append((i, record))
    if check and mapped:
        problems = check([r for _, r in mapped])
        errors += [RowError(source, i, p, r.id) for (i, r), p in zip(mapped, problems) if p]
        mapped = [(i, r) for (i, r), p in zip(mapped, problems) if not p]
        errors.sort(key=lambda e: e.row)
    return [r for _, r in mapped], errors


def _row_id(row: dict) -> str | None:
    for name in ("id", "unique_id", "task_id", "question_id", "ID", "idx"):
        if row.get(name) is not None:
            return str(row[name])
    return None


def _deepscaler(source: str) -> Callable[[dict, int], DataRecord]:
    def to_record(row: dict, i: int) -> DataRecord:
        problem, answer = get_field(row, "problem"), get_field(row, "answer")
        return DataRecord(id=f"{source}-{i}", prompt=f"{problem}\n\n{MATH_INSTRUCTION}", kind="math",
                          answer=str(answer).strip())

    return to_record


def _verl(source: str) -> Callable[[dict, int], DataRecord]:
    def to_record(row: dict, i: int) -> DataRecord:
        prompt = _user_message(get_field(row, "prompt"))
        reward = get_field(row, "reward_model")
        if not isinstance(reward, dict) or "ground_truth" not in reward:
            raise ValueError(f"'reward_model' must be an object with 'ground_truth', got {str(reward)[:80]}")
        truth = reward["ground_truth"]
        extra = row.get("extra_info") or {}
        record_id = str(extra.get("index", f"{source}-{i}")) if isinstance(extra, dict) else f"{source}-{i}"
        metadata = {k: row[k] for k in ("data_source", "ability") if k in row}
        if str(row.get("ability", "")).lower() == "code":
            return DataRecord(record_id, prompt, "code", tests=code_tests(truth), metadata=metadata)
        answers = _answers(truth)
        if len(answers) > 1:
            metadata["answers"] = answers
        return DataRecord(record_id, prompt, "math", answer=answers[0], metadata=metadata)

    return to_record


def _user_message(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise ValueError(f"'prompt' must be a string or chat messages with a user turn, got {str(prompt)[:80]}")


def _answers(truth) -> list[str]:
    if isinstance(truth, str) and truth.strip().startswith("["):
        try:
            value = ast.literal_eval(truth.strip())
        except (ValueError, SyntaxError):
            value = None
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return [v.strip() for v in value]
    answers = truth if isinstance(truth, list) else [truth]
    answers = [str(a).strip() for a in answers if str(a).strip()]
    if not answers:
        raise ValueError("the ground truth answer is empty")
    return answers


def code_tests(truth) -> list[CodeTest]:
    """Tests from a code ground truth: JSON (or an object) with inputs/outputs[/fn_name] or assert_case."""
    spec = json.loads(truth) if isinstance(truth, str) else truth
    if isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        return io_tests(spec["inputs"], spec["outputs"], spec.get("fn_name") or None)
    if isinstance(spec, dict) and isinstance(spec.get("assert_case"), list) and spec["assert_case"]:
        return [AssertTest(str(code)) for code in spec["assert_case"]]
    keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
    raise ValueError(f"code ground truth has {keys}; expected 'inputs' and 'outputs' (optionally "
                     f"'fn_name') or a non-empty 'assert_case' list")


SCHEMAS = {"deepscaler": _deepscaler, "verl": _verl}


def detect_schema(columns: set[str]) -> str:
    """The schema whose required columns are all present."""
    if {"problem", "answer"} <= columns:
        return "deepscaler"
    if {"prompt", "reward_model"} <= columns:
        return "verl"
    raise ValueError(
        f"cannot tell the data schema from the columns {sorted(columns)}: expected 'problem' and "
        f"'answer' (DeepScaleR) or 'prompt' and 'reward_model' (DAPO-Math-17k, Skywork-OR1)"
    )


def load_training_data(path: str | Path, schema: str = "auto") -> LoadResult:
    """Load a local training file, detecting its schema unless `schema` names one."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"data file {str(path)!r} has no rows")
    if schema == "auto":
        schema = detect_schema(set(rows[0]))
    elif schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}: use 'auto' or one of {sorted(SCHEMAS)}")
    source = Path(path).stem
    records, errors = map_rows(source, rows, SCHEMAS[schema](source))
    return LoadResult(records, errors, schema)
