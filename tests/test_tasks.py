import os

os.environ["HF_HUB_OFFLINE"] = "1"

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gppo.models.embedded import build_tokenizer
from gppo.problem import Problem
from gppo.tasks import TASKS, AdditionTask, CountdownTask, get_task, heldout_problems
from gppo.tasks.countdown import evaluate


def test_addition_format_and_score():
    task = AdditionTask()
    p = Problem("123+456=", "9750", {"a": 123, "b": 456})
    assert task._reversed_sum(123, 456, None) == "9750"
    assert task._reversed_sum(999, 999, None) == "8991"  # 1998 reversed
    assert task.score(p, "9750") == 1.0 and task.score(p, " 9750\n") == 1.0
    assert task.score(p, "0579") == 0.0 and task.score(p, "975") == 0.0 and task.score(p, "") == 0.0
    q = task.sample(random.Random(0))
    assert q.prompt == f"{q.metadata['a']:03d}+{q.metadata['b']:03d}=" and len(q.answer) == 4
    assert int(q.answer[::-1]) == q.metadata["a"] + q.metadata["b"]


def test_addition_teacher_drops_carries_at_the_given_rate():
    task, rng = AdditionTask(), random.Random(1)
    problems = [task.sample(rng) for _ in range(4000)]
    acc = sum(task.score(p, task.demonstration(p, rng)) for p in problems) / len(problems)
    assert 0.41 < acc < 0.49  # E[0.5 ** carries] = 0.45 for 3 digits
    no_carry = [p for p in problems if all(int(x) + int(y) < 10 for x, y in zip(p.prompt[:3], p.prompt[4:7]))]
    assert len(no_carry) > 100
    assert all(task.score(p, task.demonstration(p, rng)) == 1.0 for p in no_carry)
    perfect = AdditionTask(drop_carry=0.0)
    assert all(perfect.score(p, perfect.demonstration(p, rng)) == 1.0 for p in problems[:500])


def test_addition_short_operands_only_change_the_prompt_distribution():
    task, rng = AdditionTask(short_operands=1.0), random.Random(4)
    problems = [task.sample(rng) for _ in range(600)]
    assert sum(p.metadata["a"] < 10 for p in problems) > 100  # about a third are one-digit
    assert all(len(p.prompt) == 8 and int(p.answer[::-1]) == p.metadata["a"] + p.metadata["b"] for p in problems)
    with pytest.raises(ValueError, match="short_operands"):
        AdditionTask(short_operands=2)


def test_countdown_targets_are_reachable_and_teacher_is_imperfect():
    task, rng = CountdownTask(), random.Random(2)
    problems = [task.sample(rng) for _ in range(3000)]
    assert all(task.score(p, p.metadata["solution"]) == 1.0 for p in problems)
    assert {len(p.metadata["numbers"]) for p in problems} == {3, 4}
    demos = [task.demonstration(p, rng) for p in problems]
    acc = sum(task.score(p, d) for p, d in zip(problems, demos)) / len(problems)
    assert 0.25 < acc < 0.40
    assert len({len(d) for d in demos}) >= 3  # variable-length answers


def test_countdown_verifier():
    nums = [3, 5, 7]
    assert evaluate("(3+5)*7", nums) == 56
    assert evaluate(" 7*5 ", nums) == 35  # subsets allowed: at most once
    assert evaluate("7-5-3", nums) == -1  # evaluated as written: (7-5)-3
    assert evaluate("7/(5-3)", nums) is None  # inexact division
    assert evaluate("3+3", nums) is None  # 3 used twice
    assert evaluate("3/(5-5)", [3, 5, 5]) is None  # division by zero
    assert evaluate("-3+7", nums) is None  # no unary minus
    p = Problem("3 5 7 -> 56:", "56", {"numbers": nums, "target": 56})
    task = CountdownTask()
    assert task.score(p, "(3+5)*7") == 1.0 and task.score(p, "7*(5+3)") == 1.0
    assert task.score(p, "3*5+7") == 0.0 and task.score(p, "56") == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "__import__('os').system('echo hi')",
        "2**99999",
        "9**9**9**9",
        "3**5",
        "open('x')",
        "1e3",
        "0x3",
        "3_0",
        "7.0",
        "[3]",
        "(3,5)",
        "3;5",
        "lambda: 3",
        "",
        "   ",
        "(" * 60 + "3" + ")" * 60,
        "3" * 10_000,
        "3+" * 200 + "3",
        "3 5",
        "((3+5)",
        "3+",
        "07",
    ],
)
def test_countdown_verifier_refuses_malformed_and_malicious(text):
    assert evaluate(text, [3, 5, 7, 30, 7, 9]) is None


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ", max_size=40))
def test_countdown_verifier_never_raises(text):
    value = evaluate(text, [1, 2, 3, 4])
    assert value is None or isinstance(value, int)


@pytest.mark.parametrize("name", sorted(n for n, t in TASKS.items() if getattr(t, "embedded_model", True)))
def test_prompts_and_demonstrations_are_in_the_vocabulary(name):
    task, rng = get_task(name), random.Random(3)
    tok = build_tokenizer(getattr(task, "extra_chars", ""))
    for _ in range(200):
        p = task.sample(rng)
        ids = tok(p.prompt + task.demonstration(p, rng))["input_ids"]
        assert tok.unk_token_id not in ids


def test_get_task_typo_names_the_closest():
    assert isinstance(get_task("addition", digits=2), AdditionTask)
    with pytest.raises(ValueError, match="did you mean 'countdown'"):
        get_task("countdwn")
    with pytest.raises(ValueError, match="valid tasks: addition, countdown, multiplication, word-problems"):
        get_task("zzz")


def test_heldout_is_fixed():
    task = get_task("countdown")
    a, b = heldout_problems(task, 50, seed=7), heldout_problems(task, 50, seed=7)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in heldout_problems(task, 50, seed=8)]


def _solve_word_problem(text: str) -> int:
    """An independent solver: the two numbers of the text and the operation named by its verb."""
    import re

    a, b = (int(x) for x in re.findall(r"\d+", text))
    if "more" in text:
        return a + b
    if "gives away" in text:
        return a - b
    if "in each box" in text:
        return a * b
    assert "equally among" in text
    assert a % b == 0
    return a // b


def test_word_problems_answers_and_scoring():
    from gppo.tasks import WordProblemTask

    task, rng = get_task("word-problems"), random.Random(0)
    problems = [task.sample(rng) for _ in range(400)]
    assert {p.metadata["operation"] for p in problems} == {"add", "subtract", "multiply", "divide"}
    for p in problems:
        assert p.prompt.endswith("Put the final answer in \\boxed{}.")
        assert int(p.answer) == _solve_word_problem(p.prompt.split("?")[0]) and int(p.answer) >= 0
    p = problems[0]
    right, wrong = int(p.answer), int(p.answer) + 1
    assert task.score(p, f"So the total is \\boxed{{{right}}}.") == 1.0
    assert task.score(p, f"First \\boxed{{{wrong}}}, no wait: \\boxed{{{right}}}") == 1.0  # last box wins
    assert task.score(p, f"\\boxed{{{right}}} then \\boxed{{{wrong}}}") == 0.0
    assert task.score(p, f"The answer is {right}.") == 1.0 and task.score(p, f"#### {right}") == 1.0
    assert task.score(p, f"{right}") == 0.0  # a bare number is not an answer
    assert task.score(p, "\\boxed{twelve}") == 0.0 and task.score(p, "") == 0.0
    assert task.score(p, task.demonstration(p, rng)) == 1.0
    with pytest.raises(ValueError, match="operations"):
        WordProblemTask(operations=("add", "power"))
    with pytest.raises(ValueError, match="max_operand"):
        WordProblemTask(max_operand=1)
    from gppo.models.assets import embedded_checkpoint

    with pytest.raises(ValueError, match="give --model"):
        embedded_checkpoint("word-problems")


def test_multiplication_scores_the_models_own_answer_after_the_tool_output():
    """The answer is the text after the last fence: the product written after the output block
    scores, the output block alone does not; the teacher calls the tool about p_tool of the time
    and is right exactly then (its answers in its head have one wrong digit)."""
    task, rng = get_task("multiplication"), random.Random(0)
    p = task.sample(rng)
    a, b = p.metadata["a"], p.metadata["b"]
    assert p.prompt == f"{a}*{b}=" and p.answer == str(a * b) and 100 <= min(a, b) and max(a, b) <= 999
    block = f"```python\nprint({a}*{b})\n```\n```output\n{a * b}\n```\n"
    assert task.score(p, block + str(a * b)) == 1.0
    assert task.score(p, block) == 0.0
    assert task.score(p, str(a * b)) == 1.0
    demos = [(q, task.demonstration(q, rng)) for q in (task.sample(rng) for _ in range(400))]
    used_tool = [d.startswith("```python") for _, d in demos]
    right = [task.score(q, d) == 1.0 for q, d in demos]
    assert used_tool == right
    assert 0.4 < sum(used_tool) / len(demos) < 0.6
