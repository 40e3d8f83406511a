"""Training data: every file format and schema, the mapping flags, extra columns reaching reward
functions, data without answers, and the errors a user can run into."""

import json
from pathlib import Path

import pytest

from gppo.data.loaders import MATH_INSTRUCTION, load_training_data, read_rows, reference_answer
from gppo.rewards.code import CallTest, StdioTest
from gppo.rewards.pipeline import RewardPipeline
from gppo.trainer.data import DataOptions, build_problem_set

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"

# GSM8K's public schema: the answer is a worked solution whose last line is "#### N"
GSM8K = [
    {
        "question": "Toy: Ana has 3 bags of 4 apples. How many apples?",
        "answer": "3 * 4 = <<3*4=12>>12 apples.\n#### 12",
    },
    {
        "question": "Toy: a shop sells 800 cups, then twice as many. How many in all?",
        "answer": "800 * 2 = 1600.\n800 + 1600 = 2400.\n#### 2,400",
    },
]
# MATH's public schema: the answer is the last \boxed{} of the solution (nested braces)
MATH = [
    {
        "problem": "Toy: what is half of one?",
        "level": "Level 1",
        "type": "Algebra",
        "solution": "Half of one is $\\boxed{\\frac{1}{2}}$, not $\\boxed{2}$... so $\\boxed{\\frac{1}{2}}$.",
    }
]
PLAIN = [{"prompt": "Toy: 2 + 3?", "answer": "5"}, {"prompt": "Toy: 7 - 4?", "answer": 3}]  # mixed types: JSON


def write(rows: list[dict], path: Path) -> Path:
    """`rows` in the format named by the suffix of `path` (a directory: datasets.save_to_disk)."""
    import datasets

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["gsm8k.jsonl", "gsm8k.json", "gsm8k.parquet", "gsm8k.csv", "gsm8k_on_disk"])
def test_every_format_gives_the_same_records(tmp_path, name):
    result = load_training_data(write(GSM8K, tmp_path / name))
    assert [r.answer for r in result.records] == ["12", "2,400"] and not result.errors
    assert result.schema == "prompt=question, answer=answer"
    first = result.records[0]
    assert first.prompt == f"{GSM8K[0]['question']}\n\n{MATH_INSTRUCTION}" and first.kind == "math"
    assert first.columns == {"answer": GSM8K[0]["answer"]}  # every column but the prompt's


def test_save_to_disk_dataset_dict_picks_the_split(tmp_path):
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K), "test": datasets.Dataset.from_list(GSM8K[:1])}
    ).save_to_disk(str(path))
    assert [r.answer for r in load_training_data(path).records] == ["12", "2,400"]
    assert [r.answer for r in load_training_data(path, split="test").records] == ["12"]
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\], not 'validation'"):
        load_training_data(path, split="validation")


def test_plain_prompt_answer_and_the_common_prompt_names(tmp_path):
    plain = load_training_data(write(PLAIN, tmp_path / "plain.jsonl")).records
    assert [(r.prompt, r.answer) for r in plain] == [
        (f"Toy: 2 + 3?\n\n{MATH_INSTRUCTION}", "5"),
        (f"Toy: 7 - 4?\n\n{MATH_INSTRUCTION}", "3"),
    ]
    rows = [{"instruction": "Toy: 1 + 1? Put it in \\boxed{}.", "answer": "2"}]
    (record,) = load_training_data(write(rows, tmp_path / "instruction.jsonl")).records
    assert record.prompt == rows[0]["instruction"]  # already asks for \boxed: no second instruction


def test_math_solution_gives_the_last_box(tmp_path):
    (record,) = load_training_data(write(MATH, tmp_path / "math.jsonl")).records
    assert record.answer == "\\frac{1}{2}" and record.prompt.startswith("Toy: what is half")
    assert record.columns["level"] == "Level 1"
    math500 = [{**MATH[0], "answer": "0.5", "unique_id": "test/algebra/7.json"}]
    (record,) = load_training_data(write(math500, tmp_path / "math500.jsonl")).records
    assert (record.answer, record.id) == ("0.5", "test/algebra/7.json")  # the answer column comes first


def test_reference_answer_against_hand_read_values():
    assert reference_answer("work\n#### 72") == "72"
    assert reference_answer("#### 1,000") == "1,000"
    assert reference_answer("so $\\boxed{x^{2}+1}$") == "x^{2}+1"
    assert reference_answer(27.0) == "27" and reference_answer(["3", "-3"]) == "3, -3"
    assert reference_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="'answer' is empty"):
        reference_answer("\\boxed{}")


def test_conversational_prompts_are_kept_as_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Toy: 2 + 2?"}]
    result = load_training_data(write([{"prompt": messages, "answer": "4"}], tmp_path / "chat.jsonl"))
    assert result.records[0].prompt == messages and result.records[0].answer == "4"
    bad = [
        {"prompt": [{"role": "user", "text": "no content"}], "answer": "1"},
        {"prompt": [{"role": "assistant", "content": "hi"}], "answer": "1"},
    ]
    result = load_training_data(write(bad, tmp_path / "bad_chat.jsonl"))
    assert result.records == []
    assert "message 0 must be {'role'" in result.errors[0].message
    assert "has no user message" in result.errors[1].message


def test_deepscaler_dapo_and_skywork_schemas():
    deepscaler = load_training_data(FIXTURES / "deepscaler.jsonl")
    assert [r.answer for r in deepscaler.records] == ["8", "3"] and deepscaler.schema == "prompt=problem, answer=answer"
    assert deepscaler.records[0].prompt.endswith("\\boxed{}.")
    assert deepscaler.records[0].columns == {"answer": "8", "solution": "Add."}
    dapo = load_training_data(FIXTURES / "dapo_math.jsonl")
    record = dapo.records[0]
    assert dapo.schema == "verl" and record.answer == "11" and record.id == "a0b1c2"
    assert record.prompt[0]["role"] == "user" and record.prompt[0]["content"].startswith("Solve the toy problem.")
    assert record.columns["reward_model"]["ground_truth"] == "11" and record.columns["data_source"] == "math_dapo"
    skywork = load_training_data(FIXTURES / "skywork_math.jsonl").records[0]
    assert skywork.answer == "3" and skywork.metadata["answers"] == ["3", "3.0"]


def test_skywork_code_rows():
    result = load_training_data(FIXTURES / "skywork_code.jsonl")
    stdin, call = result.records
    assert stdin.kind == "code" and stdin.tests == [StdioTest("1 2\n", "3\n"), StdioTest("5 5\n", "10\n")]
    assert call.tests == [CallTest("negate", [3], -3), CallTest("negate", [-2], 2)]
    assert len(result.errors) == 1 and "code ground truth has ['cases']" in result.errors[0].message


def test_mapping_flags(tmp_path):
    rows = [{"text": "Toy: 9 / 3?", "target": "#### 3", "question": "not this one"}]
    path = write(rows, tmp_path / "custom.csv")
    (record,) = load_training_data(path, prompt_field="text", answer_field="target").records
    assert record.prompt.startswith("Toy: 9 / 3?") and record.answer == "3"
    assert record.columns == {"target": "#### 3", "question": "not this one"}
    with pytest.raises(
        ValueError,
        match=r"answer_field 'label' is not a column: the columns found are "
        r"\['question', 'target', 'text'\]",
    ):
        load_training_data(path, prompt_field="text", answer_field="label")
    dapo = load_training_data(FIXTURES / "dapo_math.jsonl", answer_field="data_source")  # named: not verl
    assert dapo.records[0].answer == "math_dapo"


def test_unmappable_columns_list_the_columns_and_the_flags(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"cannot find the prompt: the columns found are \['label', "
        r"'question_text'\]; map the prompt with --prompt_field .*--answer_field",
    ):
        load_training_data(FIXTURES / "unknown_schema.jsonl")
    path = write([{"question": "Toy?", "label": "1"}], tmp_path / "noanswer.jsonl")
    with pytest.raises(
        ValueError,
        match=r"cannot find the answer: the columns found are \['label', 'question'\]"
        r".*--answer_field.*--reward_funcs",
    ):
        load_training_data(path)
    clash = write([{"prompt": "x", "answer": "1", "completions": "y"}], tmp_path / "clash.jsonl")
    with pytest.raises(ValueError, match=r"columns \['completions'\] clash with reward-function arguments"):
        load_training_data(clash)


def test_missing_sources_are_clear_errors(micro_model, tmp_path, capsys):
    from gppo.cli import main

    with pytest.raises(FileNotFoundError, match="does not exist.*needs --from_hub"):
        read_rows(tmp_path / "openai/gsm8k")
    # the Hub is asked only with from_hub (offline in tests: a clear error, no traceback)
    with pytest.raises(
        ValueError, match=r"could not load gppo-tests/none \(config 'main', split 'train'\) from the Hub"
    ):
        read_rows("gppo-tests/none", from_hub=True, config="main")
    assert (
        main(
            [
                "train",
                "--data",
                "gppo-tests/none",
                "--from_hub",
                "true",
                "--model",
                str(micro_model),
                "--output_dir",
                str(tmp_path / "run"),
                "--threads",
                "1",
            ]
        )
        == 2
    )
    assert "gppo train: error: could not load gppo-tests/none" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' is empty"):
        load_training_data(empty)
    no_rows = tmp_path / "no_rows.json"
    no_rows.write_text("[]")
    with pytest.raises(ValueError, match="no_rows.json' has no rows"):
        load_training_data(no_rows)


def test_extra_columns_reach_reward_functions_and_no_verifier_is_needed(tmp_path):
    rows = [{"instruction": f"Toy: say {w}.", "keyword": w, "weight": i} for i, w in enumerate("abcdef")]
    path = write(rows, tmp_path / "open.parquet")
    with pytest.raises(ValueError, match="cannot find the answer"):
        build_problem_set("addition", str(path), None, 2, seed=0)
    problems = build_problem_set("addition", str(path), None, 2, seed=0, need_answer=False)
    assert problems.verifier is None and [p.metadata["kind"] for p in problems.heldout] == ["reward"] * 2
    seen = {}

    def says_keyword(prompts, completions, keyword, weight, **kwargs):
        seen.update(prompts=prompts, keyword=keyword, weight=weight, other=sorted(kwargs))
        return [float(k in c) for c, k in zip(completions, keyword)]

    pipeline = RewardPipeline(None, [("says_keyword", says_keyword)], weights=[2.0])
    batch = problems.train.take(3)
    out = pipeline(batch, ["a", batch[1].metadata["columns"]["keyword"], "zzz"], [[1], [2], [3]])
    assert seen["keyword"] == [p.metadata["columns"]["keyword"] for p in batch]
    assert seen["weight"] == [p.metadata["columns"]["weight"] for p in batch]
    assert seen["prompts"] == [p.prompt for p in batch] and seen["other"] == ["answer", "completion_ids"]
    assert out.rewards[1:] == [2.0, 0.0] and out.accuracy == out.rewards and "verifier" not in out.components
    with pytest.raises(ValueError, match="one per reward function: the data has no answers"):
        RewardPipeline(None, [("says_keyword", says_keyword)], weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="nothing scores the completions"):
        RewardPipeline(None, [])


def test_hub_and_split_options_reach_the_loader(tmp_path):
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict(
        {"main": datasets.Dataset.from_list(GSM8K * 3), "held": datasets.Dataset.from_list(GSM8K[:1])}
    ).save_to_disk(str(path))
    options = DataOptions(split="main", eval_split="held")
    problems = build_problem_set("addition", str(path), str(path), 4, seed=0, options=options)
    assert len(problems.heldout) == 1 and len(problems.train.problems) == 6
    assert problems.verifier is not None


def test_train_on_data_without_answers_end_to_end(micro_model, tmp_path):
    """A run whose only reward is a user function reading a data column: rollout, update and
    held-out evaluation (the reward functions' score) all work without a verifier."""
    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict

    rows = [{"prompt": f"{i}+{i}=", "target": str(2 * i)} for i in range(10)]
    path = write(rows, tmp_path / "open.jsonl")
    config = from_dict(
        dict(
            model=str(micro_model),
            data=str(path),
            output_dir=str(tmp_path / "run"),
            steps=1,
            prompts_per_step=2,
            group_size=2,
            max_new_tokens=4,
            eval_size=2,
            eval_samples=2,
            eval_every=0,
            mini_batch_size=4,
            micro_batch_size=4,
            save_every=0,
            progress=False,
            threads=1,
            reward_funcs=["tests.reward_fns:matches_target"],
        )
    )
    summary = Trainer(config).train()
    assert 0.0 <= summary["after"]["eval/greedy"] <= 1.0
    log = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/reward_mean" in r for r in log)


# ------------------------------------------------------------------------------ gold answers checked at load
@pytest.mark.parametrize(
    "golds, expected",
    [
        # a struct (dict) answer column: never one answer
        (
            [{"value": 5}, {"value": 3}],
            r"the answer column 'answer' holds values that are not one answer \(text or a "
            r"number\) in rows 0, 1 \(row 0: \{'value': 5\}\): .*--answer_field",
        ),
        # a list of structs
        (["3", [{"v": 1}]], r"in row 1 \(row 1: \[\{'v': 1\}\]\)"),
        # a number that is not finite (what a missing cell of a numeric column becomes)
        ([1.0, float("nan"), 2.0], r"not one answer .* in row 1 \(row 1: nan\)"),
        # mixed kinds across rows: numbers and booleans, text and lists
        (
            [5, True, 7],
            r"mixes kinds of values across rows \(text or numbers in rows 0, 2 \(row 0: 5\); booleans in "
            r"row 1 \(row 1: True\)\): give every row's answer as text or a number .*--answer_field",
        ),
        (["3", ["5"]], r"mixes kinds .*text or numbers in row 0 .*lists in row 1 \(row 1: \['5'\]\)"),
        # golds math-verify cannot read: never matched
        (
            ["3", "\\text{}", "4"],
            r"has gold answers math-verify cannot read in row 1 \(row 1: '\\\\text\{\}'\) "
            r"\(math-verify cannot parse .*correct or remove these rows, or map .*--answer_field",
        ),
    ],
)
def test_bad_gold_answers_refuse_the_file_naming_the_rows(tmp_path, golds, expected):
    rows = [{"prompt": f"Toy {i}?", "answer": g} for i, g in enumerate(golds)]
    path = tmp_path / "golds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if any(isinstance(g, float) for g in golds):  # JSON has no NaN in every reader: use parquet
        path = write(rows, tmp_path / "golds.parquet")
    with pytest.raises(ValueError, match=expected) as err:
        load_training_data(path)
    assert str(err.value).startswith(f"{path}: the answer column 'answer' ")


def test_gold_errors_show_the_first_rows_and_count_the_rest(tmp_path):
    rows = [{"prompt": f"Toy {i}?", "answer": {"v": i}} for i in range(8)]
    with pytest.raises(ValueError, match=r"in rows 0, 1, 2, 3, 4 and 3 more \(row 0: \{'v': 0\}\)"):
        load_training_data(write(rows, tmp_path / "structs.jsonl"))


def test_good_golds_of_every_kind_still_load(tmp_path):
    rows = [
        {"prompt": "a", "answer": "\\frac{1}{2}"},
        {"prompt": "b", "answer": 3},
        {"prompt": "c", "answer": "(1, 2)"},
        {"prompt": "d", "answer": "#### 2,400"},
    ]
    assert [r.answer for r in load_training_data(write(rows, tmp_path / "ok.jsonl")).records] == [
        "\\frac{1}{2}",
        "3",
        "(1, 2)",
        "2,400",
    ]
    lists = [{"prompt": "a", "answer": ["3", "-3"]}, {"prompt": "b", "answer": ["1"]}]
    assert [r.answer for r in load_training_data(write(lists, tmp_path / "lists.jsonl")).records] == ["3, -3", "1"]


def test_verl_ground_truth_is_checked_too(tmp_path):
    row = json.loads((FIXTURES / "dapo_math.jsonl").read_text().splitlines()[0])
    row["reward_model"]["ground_truth"] = {"answer": "11"}
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        ValueError,
        match=r"the answer column 'reward_model.ground_truth' holds values that are not "
        r"one answer .* fix reward_model.ground_truth",
    ):
        load_training_data(path)


def test_eval_data_golds_are_checked_before_training(tmp_path):
    train = write(GSM8K * 3, tmp_path / "train.jsonl")
    held = write([{"question": "Toy?", "answer": {"value": 1}}], tmp_path / "held.jsonl")
    with pytest.raises(ValueError, match=f"{held}: the answer column 'answer' holds values that are not one"):
        build_problem_set("addition", str(train), str(held), 4, seed=0)
