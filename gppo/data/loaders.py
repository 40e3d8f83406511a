"""Training data -> `DataRecord`s, following TRL's conventions for files and columns.

Sources (`read_rows`, all through the `datasets` library): a .jsonl / .json / .parquet / .csv
file, a `datasets.save_to_disk` directory (a `DatasetDict` picks `split`), or, only with
`from_hub=True`, a Hugging Face Hub dataset name (with its `config` and `split`).

Columns (`load_training_data`):

- `verl` schema (BytedTsinghua-SIA/DAPO-Math-17k; Skywork/Skywork-OR1-RL-Data, splits `math`
  and `code`), when `prompt` and `reward_model` are present and no answer column is named:
  `data_source`, `prompt` (chat messages, which already hold the instructions), `ability`
  ("MATH", "math" or "code"), `reward_model` (`{"ground_truth", "style"}`), `extra_info`
  (`{"index", ...}`). The math ground truth is the answer (DAPO) or a Python-literal list of
  accepted answers such as "['3']" (Skywork; the first is `answer`, and `metadata["answers"]`
  lists them when there are several). The code ground truth is JSON: `{"inputs", "outputs",
  "fn_name"?}` (stdin/stdout, or calls when `fn_name` is set) or `{"assert_case": [code, ...]}`.
- otherwise the prompt is `prompt_field`, or the first of `PROMPT_COLUMNS` present (text or
  chat messages), and the answer `answer_field`, or the first of `ANSWER_COLUMNS` present. This
  covers plain {"prompt", "answer"} files, GSM8K ({"question", "answer": "... #### 72"}), MATH and
  MATH-500 ({"problem", "solution" with \\boxed{}}, MATH-500 also "answer") and DeepScaleR
  ({"problem", "answer", "solution"}). The reference answer is `reference_answer` of the value:
  the last \\boxed{} or the text after the last "####" when present, else the value itself. Text
  prompts of math problems get `MATH_INSTRUCTION` appended unless they already mention \\boxed.
  Without an answer column the records have no verifier (kind "reward"): reward functions score them.

Every column but the prompt's is kept in `DataRecord.columns` and reaches reward functions as a
keyword argument (TRL's convention); `answer` is always the reference answer. Rows that do not fit
are reported as `RowError`s; the other rows still load.

Math gold answers are checked before anything trains on them (`check_gold_answers`), and a data
set with a bad one is refused as a whole (an error naming the file, the column, the first rows,
their values and the fix), since such a gold can never be matched: a struct (dict) or a list of
structs, a number that is not finite (a missing CSV cell), one column mixing kinds (text or
numbers, booleans, lists), or a gold math-verify cannot read.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from gppo.prompts import Prompt, check_messages
from gppo.rewards.code import AssertTest, CodeTest, io_tests
from gppo.rewards.math import check_golds, extract_answer

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_COLUMNS = ("prompt", "question", "problem", "instruction")
ANSWER_COLUMNS = ("answer", "solution")
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# reward-function arguments that gppo fills itself: a data column may not take these names
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")


@dataclass(frozen=True)
class DataRecord:
    """One problem: a math `answer`, code `tests`, or neither (kind "reward": scored by reward
    functions only), with the prompt (text or chat messages) and the row's other columns."""

    id: str
    prompt: Prompt
    kind: str  # "math", "code" or "reward"
    answer: str | None = None
    tests: list[CodeTest] | None = None
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
    columns: dict = field(default_factory=dict, compare=False, hash=False)


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


def read_rows(
    source: str | Path, *, from_hub: bool = False, split: str = "train", config: str | None = None
) -> list[dict]:
    """Rows of a data file, a `save_to_disk` directory, or (with `from_hub`) a Hub dataset, read with `datasets`."""
    import datasets  # slow to import: only when data is read

    path = Path(source)
    if from_hub:
        load = partial(datasets.load_dataset, str(source), config, split=split)
    elif path.is_dir():
        load = partial(datasets.load_from_disk, str(path))
    elif path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"unsupported data file type {path.suffix!r} ({path}): use "
                f"{', '.join(FILE_BUILDERS)} or a datasets.save_to_disk directory"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"data file {str(path)!r} is empty")
        load = partial(datasets.load_dataset, builder, data_files=str(path), split="train")
    else:
        raise FileNotFoundError(
            f"data {str(source)!r} does not exist: give a .jsonl/.json/.parquet/.csv file or a "
            "datasets.save_to_disk directory (a Hub dataset name needs --from_hub)"
        )
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # per-file bars would interleave with gppo's own progress
    try:
        data = load()
    except Exception as err:  # datasets wraps parse, network and format errors in its own types
        cause = err.__cause__ or err
        if from_hub:
            raise ValueError(
                f"could not load {source} (config {config!r}, split {split!r}) from the Hub: {cause}; "
                "download it and pass the local file"
            ) from err
        if "corresponds to no data" in str(cause):
            raise ValueError(f"data {str(source)!r} has no rows") from None
        raise ValueError(f"could not read {source}: {type(cause).__name__}: {cause}") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path} holds the splits {sorted(data)}, not {split!r}: choose one as the split")
        data = data[split]
    return data.to_list()


def get_field(row: dict, *names: str):
    """The value of the first of `names` present (not None) in `row`; a clear error if none is."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    wanted = " or ".join(repr(n) for n in names)
    raise ValueError(f"missing field {wanted} (columns seen: {_present(row)})")


def _present(row: dict) -> str:
    """The row's columns that hold a value (tables fill a row's missing columns with None)."""
    return ", ".join(sorted(k for k, v in row.items() if v is not None))


def map_rows(
    source: str,
    rows: list[dict],
    to_record: Callable[[dict, int], DataRecord],
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


def reference_answer(value, name: str = "answer") -> str:
    """The reference answer in a column value: the last \\boxed{} (MATH solutions) or the text after
    the last "####" (GSM8K) when there is one, else the value; lists join with ", ", 27.0 reads 27."""
    if isinstance(value, list):
        value = ", ".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        text = extract_answer(text) or ""
    if not text:
        raise ValueError(f"the answer field {name!r} is empty or has an empty \\boxed{{}} / #### answer")
    return text


def _math_prompt(prompt: Prompt) -> Prompt:
    """Text prompts get the \\boxed{} instruction unless they mention \\boxed; conversations are kept."""
    if isinstance(prompt, str) and "\\boxed" not in prompt:
        return f"{prompt}\n\n{MATH_INSTRUCTION}"
    return prompt


def _prompt_value(row: dict, name: str) -> Prompt:
    value = row.get(name)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"the prompt field {name!r} is empty")
        return value
    if value is None:
        raise ValueError(f"missing field {name!r} (columns seen: {_present(row)})")
    return check_messages(value, f"the prompt field {name!r}")


def _columns(source: str, prompt_field: str, answer_field: str | None) -> Callable[[dict, int], DataRecord]:
    def to_record(row: dict, i: int) -> DataRecord:
        prompt = _prompt_value(row, prompt_field)
        record_id = _row_id(row) or f"{source}-{i}"
        columns = {k: v for k, v in row.items() if k != prompt_field}
        if answer_field is None:
            return DataRecord(record_id, prompt, "reward", columns=columns)
        answer = reference_answer(get_field(row, answer_field), answer_field)
        return DataRecord(record_id, _math_prompt(prompt), "math", answer=answer, columns=columns)

    return to_record


def _verl(source: str) -> Callable[[dict, int], DataRecord]:
    def to_record(row: dict, i: int) -> DataRecord:
        prompt = _prompt_value(row, "prompt")
        reward = get_field(row, "reward_model")
        if not isinstance(reward, dict) or reward.get("ground_truth") is None:
            raise ValueError(f"'reward_model' must be an object with 'ground_truth', got {str(reward)[:80]}")
        truth = reward["ground_truth"]
        extra = row.get("extra_info") or {}
        index = extra.get("index") if isinstance(extra, dict) else None
        record_id = f"{source}-{i}" if index is None else str(index)
        metadata = {k: row[k] for k in ("data_source", "ability") if k in row}
        columns = {k: v for k, v in row.items() if k != "prompt"}
        if str(row.get("ability", "")).lower() == "code":
            return DataRecord(record_id, prompt, "code", tests=code_tests(truth), metadata=metadata, columns=columns)
        answers = _answers(truth)
        if len(answers) > 1:
            metadata["answers"] = answers
        return DataRecord(record_id, prompt, "math", answer=answers[0], metadata=metadata, columns=columns)

    return to_record


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
    raise ValueError(
        f"code ground truth has {keys}; expected 'inputs' and 'outputs' (optionally "
        f"'fn_name') or a non-empty 'assert_case' list"
    )


def _mapping_flags() -> str:
    return (
        f"map the prompt with --prompt_field (default: the first of {', '.join(PROMPT_COLUMNS)}; text or chat "
        f"messages) and the answer with --answer_field (default: the first of {', '.join(ANSWER_COLUMNS)}), or "
        "use the verl schema ('prompt' and 'reward_model', as DAPO-Math-17k and Skywork-OR1)"
    )


def map_columns(
    columns: list[str], prompt_field: str | None = None, answer_field: str | None = None, need_answer: bool = True
) -> tuple[str, str | None, str]:
    """(prompt column, answer column or None, schema name) for a table with `columns`; a clear error
    listing the columns found and the flags that map them when they cannot be mapped."""
    found = f"the columns found are {sorted(columns)}"
    for flag, name in (("prompt_field", prompt_field), ("answer_field", answer_field)):
        if name is not None and name not in columns:
            raise ValueError(f"{flag} {name!r} is not a column: {found}")
    clash = sorted(set(columns) & set(RESERVED_COLUMNS))
    if clash:
        raise ValueError(
            f"the columns {clash} clash with reward-function arguments of the same name "
            f"({', '.join(RESERVED_COLUMNS)}): rename them in the data"
        )
    if prompt_field is None and answer_field is None and {"prompt", "reward_model"} <= set(columns):
        return "prompt", None, "verl"
    prompt = prompt_field or next((c for c in PROMPT_COLUMNS if c in columns), None)
    if prompt is None:
        raise ValueError(f"cannot find the prompt: {found}; {_mapping_flags()}")
    answer = answer_field or next((c for c in ANSWER_COLUMNS if c in columns and c != prompt), None)
    if answer is None and need_answer:
        raise ValueError(
            f"cannot find the answer: {found}; {_mapping_flags()}. Without an answer column, give "
            "reward functions (--reward_funcs) to score completions instead of the math verifier"
        )
    return prompt, answer, f"prompt={prompt}, answer={answer}"


def load_training_data(
    source: str | Path,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    need_answer: bool = True,
    from_hub: bool = False,
    split: str = "train",
    config: str | None = None,
) -> LoadResult:
    """Load training data (see the module docstring for sources and columns). `need_answer=False`
    allows data without an answer column (scored by reward functions only). Bad math gold answers
    raise a ValueError (`check_gold_answers`)."""
    rows = read_rows(source, from_hub=from_hub, split=split, config=config)
    if not rows:
        raise ValueError(f"data {str(source)!r} has no rows")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    prompt, answer, schema = map_columns(columns, prompt_field, answer_field, need_answer)
    name = Path(str(source)).stem or str(source)
    if schema == "verl":
        golds = [
            (i, row["reward_model"].get("ground_truth"))
            for i, row in enumerate(rows)
            if isinstance(row.get("reward_model"), dict) and str(row.get("ability", "")).lower() != "code"
        ]
        check_gold_answers(str(source), "reward_model.ground_truth", golds, lambda truth: _answers(truth)[0])
    elif answer is not None:
        golds = [(i, row[answer]) for i, row in enumerate(rows) if row.get(answer) is not None]
        check_gold_answers(str(source), answer, golds, lambda value: reference_answer(value, answer))
    to_record = _verl(name) if schema == "verl" else _columns(name, prompt, answer)
    records, errors = map_rows(name, rows, to_record)
    return LoadResult(records, errors, schema)


SHOWN_ROWS = 5  # rows named in a gold-answer error


def _gold_kind(value) -> str | None:
    """The kind of a gold answer value, or None when no gold of that kind can be matched."""
    if isinstance(value, bool):
        return "booleans"
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float)):
        return "text or numbers"
    if isinstance(value, list) and all(_gold_kind(v) == "text or numbers" for v in value):
        return "lists"
    return None


def check_gold_answers(
    source: str, column: str, golds: list[tuple[int, object]], to_text: Callable[[object], str]
) -> None:
    """Refuse (ValueError) gold answers that can never be matched: values that are not one answer
    (a struct, a list of structs, a non-finite number), a column mixing kinds of values, or golds
    math-verify cannot read. `golds` holds (row, raw value); `to_text` makes the reference answer
    (its ValueErrors are left to the row mapping, which skips such rows with a warning)."""
    where = f"{source}: the answer column {column!r}"
    flags = (
        "map the column that holds the answer with --answer_field"
        if column != "reward_model.ground_truth"
        else "fix reward_model.ground_truth"
    )
    not_one = [(i, v) for i, v in golds if _gold_kind(v) is None]
    if not_one:
        raise ValueError(
            f"{where} holds values that are not one answer (text or a number) in {_rows(not_one)}: "
            f"a gold answer must be one value per row; {flags}, or flatten these values in the data"
        )
    by_kind: dict[str, list[tuple[int, object]]] = {}
    for i, value in golds:
        by_kind.setdefault(_gold_kind(value), []).append((i, value))
    if len(by_kind) > 1:
        kinds = "; ".join(f"{kind} in {_rows(values)}" for kind, values in by_kind.items())
        raise ValueError(
            f"{where} mixes kinds of values across rows ({kinds}): give every row's answer as "
            f"text or a number (one kind for the whole column), or {flags}"
        )
    texts = []
    for i, value in golds:
        try:
            texts.append((i, value, to_text(value)))
        except ValueError:
            continue
    problems = check_golds([text for _, _, text in texts])
    bad = [(i, value, problem) for (i, value, _), problem in zip(texts, problems) if problem]
    if bad:
        raise ValueError(
            f"{where} has gold answers math-verify cannot read in {_rows([(i, v) for i, v, _ in bad])} "
            f"({bad[0][2]}): such a gold is never matched, so these problems would always score 0; "
            f"correct or remove these rows, or {flags}"
        )


def _rows(values: list[tuple[int, object]]) -> str:
    """'rows 3, 7 (row 3: {'v': 1})': the first SHOWN_ROWS row numbers and the first value."""
    shown = ", ".join(str(i) for i, _ in values[:SHOWN_ROWS])
    more = f" and {len(values) - SHOWN_ROWS} more" if len(values) > SHOWN_ROWS else ""
    first, value = values[0]
    return f"{'row' if len(values) == 1 else 'rows'} {shown}{more} (row {first}: {repr(value)[:80]})"
