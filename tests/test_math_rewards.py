"""Math rewards: answer extraction, math-verify equivalence, timeouts outside the main thread."""

import threading
import time

import pytest

from gppo.rewards.math import (
    MathVerdict,
    check_golds,
    equation_sides,
    extract_answer,
    hedge_form,
    normalize_gold,
    score_math,
)

C, W, H = MathVerdict.CORRECT, MathVerdict.WRONG, MathVerdict.HEDGED

# (gold, predicted answer, verdict): the prediction is scored as "\boxed{<predicted>}".
PAIRS = [
    # fractions and decimals
    ("\\frac{1}{2}", "0.5", C),
    ("\\frac{1}{2}", "1/2", C),
    ("\\frac12", "\\dfrac{1}{2}", C),
    ("0.5", "\\frac{2}{4}", C),
    ("-\\frac{3}{4}", "-0.75", C),
    ("\\frac{-3}{4}", "-\\frac34", C),
    ("\\frac{9}{2}", "4\\frac{1}{2}", C),
    ("\\frac{1}{3}", "0.333333", C),
    ("\\frac{1}{3}", "0.33", W),
    ("\\frac{1}{2}", "0.51", W),
    ("\\frac{1}{2}", "\\frac{2}{1}", W),
    ("3", "3.0", C),
    ("0", "0.0", C),
    ("1000", "1,000", C),
    ("1000", "1{,}000", C),
    ("100", "100.0001", W),
    ("-2", "2", W),
    # radicals, powers, constants, expressions
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", C),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}", C),
    ("\\sqrt{8}", "2\\sqrt{2}", C),
    ("3\\sqrt{2}", "\\sqrt{18}", C),
    ("10^{6}", "1000000", C),
    ("2^{10}", "1024", C),
    ("\\log_2 8", "3", C),
    ("\\pi", "3.14159265", C),
    ("\\pi", "3.14", W),
    ("2x+1", "1+2x", C),
    ("2x+1", "2x-1", W),
    ("x^2+2x+1", "(x+1)^2", C),
    ("x^2", "x^3", W),
    ("2+3i", "3i+2", C),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", C),
    # intervals and sets
    ("(1,2)", "(1, 2)", C),
    ("[1,2)", "[1, 2)", C),
    ("(-\\infty, 3]", "(-\\infty,3]", C),
    ("x \\in [1,2]", "[1,2]", C),
    ("[1,2]", "(1,2)", W),
    ("(1,2)", "[1,2)", W),
    ("\\{1,2\\}", "\\{2,1\\}", C),
    ("\\{1,2,3\\}", "\\{1,2\\}", W),
    # several answers
    ("1, 2", "2, 1", C),
    ("x=1, x=2", "1, 2", C),
    ("1, 2", "1, 3", W),
    ("1, 2", "1", W),
    # units, currency, degrees, percent
    ("10\\text{ cm}", "10", C),
    ("10 \\text{cm}", "10\\,\\mathrm{cm}", C),
    ("10\\text{ cm}", "11", W),
    ("12", "12 \\text{ apples}", C),
    ("5", "\\$5.00", C),
    ("90^\\circ", "90", C),
    ("50\\%", "0.5", C),
    ("5\\%", "5", C),  # math-verify accepts the number with or without its percent sign
    ("25\\%", "0.3", W),
    # equations, text, choices
    ("x=3", "3", C),
    ("3", "x=3", C),
    ("y = 2x+1", "2x+1", C),
    ("\\text{(B)}", "B", C),
    ("\\text{Evelyn}", "\\text{Evelyn}", C),
    ("\\text{even}", "\\text{odd}", W),
    ("5", "\\text{five}", W),
]


def test_the_table_is_large_enough():
    assert len(PAIRS) >= 40
    assert {v for _, _, v in PAIRS} == {C, W}


@pytest.mark.parametrize("gold, predicted, verdict", PAIRS)
def test_equivalence(gold, predicted, verdict):
    [result] = score_math([f"So the result is \\boxed{{{predicted}}}."], [gold])
    assert result.verdict is verdict, (gold, predicted, result)
    assert result.answer == predicted
    assert result.reward == (1.0 if verdict is C else 0.0)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("\\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),  # nested braces
        ("first \\boxed{1}, then \\boxed{2}", "2"),  # several boxes: the last counts
        ("\\boxed{3} and a truncated \\boxed{\\frac{1}{", "3"),  # an unclosed box is ignored
        ("\\fbox{7}", "7"),
        ("\\boxed {8}", "8"),
        ("The answer is $42$.", "42"),
        ("So the final answer is \\(\\frac{1}{2}\\)", "\\frac{1}{2}"),
        ("steps...\n**Answer:** 17\n", "17"),
        ("Answer: $x^2$", "x^2"),
        ("Natalia sold 72 clips.\n#### 72", "72"),
        ("\\boxed{5}\nthe answer is 6", "5"),  # a box wins over an anchored phrase
        ("<think>\\boxed{1}</think>The answer is 2.", "2"),  # only the text after </think>
        ("I am not sure.", None),
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# Hedges: an answer offering two values (or a relation) where the gold is one value. Each scores 0
# against either of its options; math-verify alone gives 1 against one of them (it keeps one side).
HEDGES = [
    # (options the hedge names, boxed answer, the form reported)
    (["3", "4"], "4 = 3", "an equation with a side ("),
    (["3", "4"], "3 = 4", "an equation with a side ("),
    (["1", "3"], "x = 1 = 3", "an equation with a side"),
    (["3"], "x \\approx 3", "a relation (\\approx)"),
    (["3", "2.9"], "x \\approx 2.9 \\approx 3", "a relation (\\approx)"),
    (["3", "4"], "3 \\approx 4", "a relation (\\approx)"),
    (["3"], "x < 3", "a relation (<)"),
    (["3", "4"], "3 \\le 4", "a relation (\\le)"),
    (["3", "4"], "3 \\leq x \\leq 4", "a relation (\\leq)"),
    (["3", "4"], "3 \\neq 4", "a relation (\\neq)"),
    (["3"], "x \\sim 3", "a relation (\\sim)"),
    (["3", "4"], "3 \\mid 4", "a relation (\\mid)"),
    (["3", "4"], "3 \\nmid 4", "a relation (\\nmid)"),
    (["3", "4"], "3 | 4", "a relation (|)"),
    (["3", "4"], "3 ∣ 4", "a relation (∣)"),
    (["3", "4"], "3 \\not= 4", "a relation (\\not)"),
    (["3", "4"], "3 \\supset 4", "a relation (\\supset)"),
    (["3", "4"], "3 \\ni 4", "a relation (\\ni)"),
    (["3", "4"], "3 \\parallel 4", "a relation (\\parallel)"),
    (["3", "4"], "3 \\perp 4", "a relation (\\perp)"),
    (["3", "4"], "3 \\prec 4", "a relation (\\prec)"),
    (["3", "4"], "3 \\lor 4", "a disjunction (\\lor)"),
    (["3", "4"], "3 \\vee 4", "a disjunction (\\vee)"),
    (["3", "4"], "3 \\text{ or } 4", "a disjunction (or)"),
    (["3", "4"], "3 (or 4)", "a disjunction (or)"),
    (["3", "-3"], "\\pm 3", "a disjunction (\\pm)"),
    (
        ["3", "4"],
        "\\begin{cases} 3 & n \\text{ even} \\\\ 4 & \\text{otherwise} \\end{cases}",
        "a case split (\\begin{cases})",
    ),
    (["3", "4"], "3 \\text{ if } n \\text{ is even}, 4 \\text{ otherwise}", "a case split (if)"),
    (["3", "4"], "3 if n even, 4 otherwise", "a case split (if)"),
    (["3", "4"], "3 \\\\ 4", "several lines (\\\\)"),
    (["3", "4"], "3 \\newline 4", "several lines (\\newline)"),
    (["3", "4"], "3, 4", "a set or interval of values"),
    (["3", "4"], "\\{3, 4\\}", "a set or interval of values"),
    (["3", "4"], "x = 3, y = 4", "a set or interval of values"),
    (["3", "4"], "3 \\text{ and } 4", "a set or interval of values"),
    (["3", "4"], "[3, 4]", "a set or interval of values"),
    (["1", "2"], "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "several lines"),
]


@pytest.mark.parametrize("options, answer, form", HEDGES, ids=[a for _, a, _ in HEDGES])
def test_a_hedge_scores_zero_against_each_of_its_options(options, answer, form):
    results = score_math([f"So \\boxed{{{answer}}}."] * len(options), options)
    for gold, result in zip(options, results):
        assert result.verdict is H and result.reward == 0.0, (gold, result)
        assert result.error.startswith("hedge where one value is expected: " + form), result.error


def test_hedges_that_math_verify_alone_would_accept():
    """The rules are needed: math-verify keeps one side of these (run without them, in-process)."""
    from math_verify import parse, verify

    for gold, answer in [
        ("3", "4 = 3"),
        ("4", "3 \\lor 4"),
        ("3", "x \\approx 3"),
        ("4", "3 \\\\ 4"),
        ("4", "3 (or 4)"),
        ("4", "3 \\mid 4"),
        ("4", "3 | 4"),
    ]:
        assert verify(
            parse(f"${gold}$", parsing_timeout=None), parse(f"${answer}$", parsing_timeout=None), timeout_seconds=None
        ), (gold, answer)


# Honest answers that keep scoring 1: named values, true equations, and golds that are themselves
# sets, tuples, intervals, lists, relations or text with a hedge word.
HONEST = [
    ("3", "x = 3"),
    ("3", "n=3"),
    ("3", "3 = 3"),
    ("5", "f(2) = 5"),
    ("7", "a_{10} = 7"),
    ("6", "2 \\cdot 3 = 6"),
    ("2", "x = 1 + 1"),
    ("3", "\\{3\\}"),
    ("3", "3 \\\\"),  # a trailing line break is layout
    ("\\infty", "\\infty"),  # \in is not \infty
    ("\\frac{1}{2}", "\\left(\\frac{1}{2}\\right)"),  # \le is not \left
    ("4", "|-4|"),  # bars in pairs are an absolute value
    ("4", "\\left| -4 \\right|"),
    ("3 \\mid 12", "3 \\mid 12"),  # the gold is itself a relation
    ("x=3", "3"),
    ("y = 2x+1", "y = 2x + 1"),
    ("(1, 2)", "(1,2)"),
    ("(1,2)", "(1, 2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("[0, 1)", "[0,1)"),
    ("1, 2", "2, 1"),
    ("x \\le 3", "x \\leq 3"),
    ("x \\in [1,2]", "[1,2]"),
    ("3 \\pm \\sqrt{2}", "3 \\pm \\sqrt{2}"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\text{black or white}", "\\text{black or white}"),
    ("\\text{Gordon}", "\\text{Gordon}"),  # "or" only as a word
]


@pytest.mark.parametrize("gold, answer", HONEST, ids=[f"{g} vs {a}" for g, a in HONEST])
def test_honest_answers_still_score_one(gold, answer):
    [result] = score_math([f"\\boxed{{{answer}}}"], [gold])
    assert result.verdict is C, (gold, answer, result)


def test_anchored_answers_are_checked_too():
    hedged, honest = score_math(["The answer is 3 or 4.", "The answer is $x = 4$."], ["4", "4"])
    assert (hedged.verdict, hedged.answer, honest.verdict) == (H, "3 or 4", C)


@pytest.mark.parametrize(
    "answer, gold, form",
    [
        ("3 \\lor 4", "", "a disjunction (\\lor)"),
        ("\\left(3\\right)", "", None),
        ("3 \\in S", "", "a relation (\\in)"),
        ("\\infty", "", None),
        ("\\inf S", "", None),
        ("\\neg p", "", None),
        ("3 \\ne 4", "", "a relation (\\ne)"),
        ("\\text{north or south}", "\\text{east or west}", None),  # the gold has the same form
        ("3 OR 4", "", "a disjunction (OR)"),
        ("\\text{Gordon}", "", None),
        ("3 \\\\ ", "", None),
        ("3 \\mid 4", "3 \\mid 12", None),
        ("3 \\not\\equiv 4", "", "a relation (\\not)"),
        ("3 \\ltimes 4", "", None),
        ("\\middle", "", None),
        ("|x| + |y|", "", None),
        ("\\|v\\| + \\left\\| w \\right\\|", "", None),
        ("\\left. x^2 \\right|_0^1", "", None),
        ("|x| | 4", "", "a relation (|)"),
    ],
)
def test_hedge_form_reads_commands_whole(answer, gold, form):
    assert hedge_form(answer, gold) == form


def test_equation_sides_split_only_at_the_top_level():
    assert equation_sides("x = 3") == ["x", "3"]
    assert equation_sides("x = 1 = 3") == ["x", "1", "3"]
    assert equation_sides("f(a=1) = \\frac{a=b}{2}") == ["f(a=1)", "\\frac{a=b}{2}"]
    assert equation_sides("3") == ["3"]


def test_unparsable_answers():
    none, empty = score_math(["I cannot solve this.", "\\boxed{}"], ["3", "3"])
    assert none.verdict is MathVerdict.UNPARSABLE and none.answer is None and none.reward == 0.0
    assert empty.verdict is MathVerdict.UNPARSABLE and empty.answer == ""


def test_bad_gold_answers_are_reported_not_raised():
    [empty, unreadable] = score_math(["\\boxed{1}", "\\boxed{1}"], ["  ", "\\text{}"])
    assert empty.verdict is MathVerdict.UNPARSABLE and "empty" in empty.error
    assert unreadable.verdict is MathVerdict.UNPARSABLE and "gold answer" in unreadable.error
    assert check_golds(["\\frac{1}{\\sqrt{2}}", "", "\\text{}", 27.0]) == [
        None,
        "the gold answer is empty",
        "math-verify cannot parse the gold answer '$\\\\text{}$'",
        None,
    ]


def test_gold_answers_are_wrapped_for_math_verify():
    assert normalize_gold("\\frac{1}{\\sqrt{2}}") == "$\\frac{1}{\\sqrt{2}}$"
    assert normalize_gold(27.0) == "$27$"
    assert normalize_gold("\\boxed{3}") == "\\boxed{3}"
    assert normalize_gold("$x$") == "$x$"


def test_timeout_in_a_thread_kills_only_that_comparison():
    results = []

    def run():
        results.extend(score_math(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{4}"], ["1", "4"], timeout_s=1.0))

    start = time.monotonic()
    worker = threading.Thread(target=run)  # math-verify's own signal.alarm would fail here
    worker.start()
    worker.join(timeout=60)
    assert [r.verdict for r in results] == [MathVerdict.TIMEOUT, MathVerdict.CORRECT]
    assert time.monotonic() - start < 30
    assert score_math(["\\boxed{2}"], ["2"])[0].verdict is MathVerdict.CORRECT  # the pool recovered


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="2 completions but 1 gold answers"):
        score_math(["a", "b"], ["1"])
