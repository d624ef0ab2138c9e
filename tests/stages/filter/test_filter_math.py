"""Math answers: extraction strategies and math-verify equivalence (fractions, LaTeX, units,
intervals), checked against values computed another way (Python's Fraction)."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from rollwise.config import TaskConfig
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.math_verifier import MathVerifier
from rollwise.tasks import Problem, load_task
from rollwise.tasks.extract import answer_is, last_boxed, last_number, make_extractor, normalize


def math_equal(gold: str, answer: str) -> bool:
    v = MathVerifier()
    verdict = v.score([Item(text=answer, problem=Problem("p", "q", gold), answer=answer)])[0]
    assert verdict.failed is None
    return verdict.rewards["math"] == 1.0


@pytest.mark.parametrize("gold, answer", [
    ("1/2", "\\frac{1}{2}"), ("\\frac12", "0.5"), ("\\dfrac{3}{4}", "0.75"),
    ("-\\frac{2}{4}", "-0.5"), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("10", "10\\text{ cm}"), ("5", "5 \\text{ meters}"), ("90", "90^\\circ"),
    ("1000", "1,000"), ("[1,2)", "[1, 2)"), ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\{1,2\\}", "\\{2,1\\}"), ("(x+1)^2", "x^2+2x+1"), ("2", "x=2"),
    ("3", "\\boxed{3}"),
])
def test_equivalent_answers(gold, answer):
    assert math_equal(gold, answer)


@pytest.mark.parametrize("gold, answer", [
    ("1/2", "\\frac{1}{3}"), ("3/4", "0.76"), ("[1,2)", "(1,2]"), ("[1,2)", "[1,2]"),
    ("(-\\infty, 3]", "(-\\infty,3)"), ("2", "3"), ("x^2", "2x"), ("\\{1,2\\}", "\\{1,3\\}"),
    ("10", "100\\text{ cm}"),
])
def test_non_equivalent_answers(gold, answer):
    assert not math_equal(gold, answer)


def test_fractions_agree_with_python_fraction():
    """\\frac{p}{q} equals its exact decimal and differs from a neighbour, as Fraction says."""
    rng = random.Random(0)
    for _ in range(12):
        q = rng.choice([2, 4, 5, 8, 10, 20, 25])
        p = rng.randint(-40, 40)
        value = Fraction(p, q)
        decimal = f"{float(value):.6f}".rstrip("0").rstrip(".")
        assert Fraction(decimal) == value  # the reference: exact
        assert math_equal(f"\\frac{{{p}}}{{{q}}}", decimal)
        assert not math_equal(f"\\frac{{{p}}}{{{q}}}", f"\\frac{{{p + 1}}}{{{q}}}")


def test_missing_answer_scores_zero_with_reason():
    v = MathVerifier()
    verdict = v.score([Item("no idea", Problem("p", "q", "3"), answer=None)])[0]
    assert verdict.rewards == {"math": 0.0} and "no answer" in verdict.info


def test_extraction_strategies():
    text = "First \\boxed{\\frac{1}{2}} then the final \\boxed{x^{2}+\\{1\\}} ok"
    assert last_boxed(text) == "x^{2}+\\{1\\}"  # the last one, braces balanced
    assert last_boxed("\\boxed{unclosed") is None
    assert answer_is("So the answer is 42. Done") == "42"
    assert answer_is("Final answer: $7/8$") == "7/8"
    assert last_number("we get 1,234 then -3.5 and finally 12/7 apples") == "12/7"
    task = load_task(TaskConfig(train_size=10, eval_size=8))
    ex = make_extractor(["boxed", "answer_is", "last_number"], task)
    assert ex("steps 3, 4 so \\boxed{7}") == "7"
    assert ex("the answer is 9.") == "9"
    assert ex("it is 5 or 6") == "6"
    assert ex("nothing here") is None
    # [] = the task's own extractor: built-in arith reverses least-significant-first digits
    assert make_extractor([], task)("15") == "51"
    with pytest.raises(ValueError, match="unknown strategy.*choose from"):
        make_extractor(["boxd"], task)


@pytest.mark.parametrize("a, b", [("1/2", "0.5"), ("\\frac{1}{2}", ".5"), ("$1,000$", "1000"),
                                  ("\\boxed{42}", "42.0"), (" X ", "x"), ("10\\text{ cm}", "10")])
def test_normalised_votes_agree(a, b):
    assert normalize(a) == normalize(b)


def test_normalised_votes_differ():
    assert normalize("1/2") != normalize("1/3")
    assert normalize("12") != normalize("21")
    assert normalize("07") != normalize("7")  # a leading zero: a digit string (reversed digits)
    assert normalize(None) is None and normalize("  ") is None


@pytest.mark.parametrize("gold, answer, ok", [
    ("2756", "52 * 53", False), ("2756", "52 * 53 is the result of 52 * 53.", False),
    ("-23", "46 - 69 = 46 - 69.", False), ("71", "44 + 27", False),
    ("2756", "52 * 53 = 2756", True), ("2756", "The product is 2756.", True),
    ("-23", "46 - 69 = -23", True), ("71", "\\boxed{71}", True), ("1/2", "\\frac{2}{4}", True),
    ("18", "18 dollars", True), ("18", "17 + 1", False),
])
def test_a_numeric_reference_needs_a_stated_number_not_an_expression(gold, answer, ok):
    """math-verify evaluates expressions, so a response that restates the problem would score
    as right: against a plain-number reference only a stated value counts."""
    assert math_equal(gold, answer) is ok


def test_numeric_literal_reads_the_stated_value():
    from rollwise.tasks.extract import numeric_literal
    assert numeric_literal("44 + 27 = 71") == "71"
    assert numeric_literal("The result of 81 + -78 is 118.") == "118"
    assert numeric_literal("10\\text{ cm}") == "10" and numeric_literal("90^\\circ") == "90"
    assert numeric_literal("-\\frac{2}{4}") == "-2/4" and numeric_literal("1,000") == "1,000"
    for expression in ("52 * 53", "16. 6 * 15 =", "3 + x", "", None):
        assert numeric_literal(expression) is None
