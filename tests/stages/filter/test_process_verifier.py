"""Process verifiers: the first wrong step found exactly on constructed traces (right, wrong at
the first step, wrong at the last, wrong only in the answer, a wrong step the final answer
hides), with the right step written in its place; equations checked exactly; plug-ins."""

from __future__ import annotations

import random

import pytest

from rollwise import registry
from rollwise.config import load_config
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.process import (
    ColumnSteps,
    EquationSteps,
    ProcessVerifier,
    StepFix,
    build_process_verifier,
    reference_steps,
)
from rollwise.tasks.arith import scratchpad
from rollwise.types import Problem

P = Problem(id="p", prompt="   347+586=", answer="933")  # 7+6+0=13;4+8+1=13;3+5+1=09;:339


def test_a_right_scratchpad_has_no_wrong_step():
    assert ColumnSteps().first_error(scratchpad(347, 586), P) is None
    assert ColumnSteps().first_error(scratchpad(347, 586) + "\n", P) is None


@pytest.mark.parametrize("response, fix", [
    # wrong at the first step: everything is replaced from the start
    ("7+6+0=12;4+8+1=13;3+5+1=09;:339", StepFix(0, 0, "7+6+0=13;")),
    # a forgotten carry at the second column
    ("7+6+0=13;4+8+0=12;3+5+1=09;:239", StepFix(1, 9, "4+8+1=13;")),
    # wrong at the last column step
    ("7+6+0=13;4+8+1=13;3+5+1=08;:338", StepFix(2, 18, "3+5+1=09;")),
    # every column right, the answer misread
    ("7+6+0=13;4+8+1=13;3+5+1=09;:329", StepFix(3, 27, ":339")),
    # a wrong step whose final answer is still right: found at the step, not the answer
    ("7+6+0=13;4+8+1=14;3+5+1=09;:339", StepFix(1, 9, "4+8+1=13;")),
    # the answer begun a column early
    ("7+6+0=13;4+8+1=13;:33", StepFix(2, 18, "3+5+1=09;")),
    # an extra column after the last one
    ("7+6+0=13;4+8+1=13;3+5+1=09;0+0+0=00;:339", StepFix(3, 27, ":339")),
    # cut off mid-step, and nothing at all
    ("7+6+0=13;4+8", StepFix(1, 9, "4+8+1=13;")),
    ("", StepFix(0, 0, "7+6+0=13;")),
])
def test_the_first_wrong_step_and_its_correction(response, fix):
    got = ColumnSteps().first_error(response, P)
    assert got == fix
    # the kept prefix is the response's own up to the step, and prefix + step is the right
    # scratchpad's prefix
    assert scratchpad(347, 586).startswith(response[:got.start] + got.text)


def test_against_a_naive_comparison_on_random_slips():
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randint(10, 99999), rng.randint(10, 99999)
        p = Problem(id="x", prompt=f"{a}+{b}=".rjust(10), answer=str(a + b))
        right = reference_steps(p)
        steps = list(right)
        k = rng.randrange(len(steps))
        bad = steps[k][:-2] + str((int(steps[k][-2]) + 1) % 10) + ";" if k < len(steps) - 1 \
            else ":" + str(rng.randint(0, 9)) + steps[k][1:]
        if bad == steps[k]:
            continue
        steps[k] = bad
        got = ColumnSteps().first_error("".join(steps), p)
        assert got == StepFix(k, len("".join(right[:k])), right[k])


def test_other_prompts_are_not_checked():
    assert ColumnSteps().first_error("anything", Problem("q", "12-3=", "9")) is None
    assert ColumnSteps().first_error("x", Problem("q", [{"role": "user", "content": "1+2="}],
                                                  "3")) is None


@pytest.mark.parametrize("text, fix", [
    ("So 34 + 56 = 90. The answer is \\boxed{90}.", None),
    ("34 + 56 = 80, so the answer is \\boxed{80}.", StepFix(0, 10, "90")),
    ("First 3 * 4 = 12, then 12 + 5 = 18.", StepFix(1, 32, "17")),
    ("2 + 3 * 4 = 14 and 7 / 2 = 3.5 and 10 / 3 = 3.33", None),
    ("10 / 3 = 3.4", StepFix(0, 9, "3.33")),  # two decimals at least
    ("7 x 8 = 56; 9 × 9 = 81; 8 ÷ 4 = 2; $3 + $4 = $7", None),
    ("5 - 9 = -4 then 6 - 1 = -5", StepFix(1, 24, "5")),
    # a wrong step the final answer hides
    ("12 + 7 = 18, wait, 12 + 7 = 19. \\boxed{19}", StepFix(0, 9, "19")),
    ("1 / 0 = 3 is undefined", None),
    ("no arithmetic here", None),
])
def test_equations_are_evaluated_exactly(text, fix):
    assert EquationSteps().first_error(text, Problem("q", "?", "0")) == fix


def test_huge_numbers_and_expressions_longer_than_the_window_are_left_unchecked():
    q = Problem("q", "?", "0")
    assert EquationSteps().first_error("9" * 40 + " + 1 = 5", q) is None
    assert EquationSteps().first_error("1 + " * 40 + "1 = 3", q) is None  # 161 characters
    assert EquationSteps().first_error("1 + " * 20 + "1 = 3", q) == StepFix(0, 84, "21")
    # model output of any shape is read once, the '=' signs counted: a long chain with no
    # result, a run of digits, a wall of '=' all come back unchecked
    for text in ("1+" * 10000, "12345" * 4000, "=" * 20000, "-1-" * 6000):
        assert EquationSteps().first_error(text, q) is None


def test_as_a_reward_channel_a_response_with_no_wrong_step_scores_one():
    items = [Item(scratchpad(347, 586), P), Item("7+6+0=12;", P)]
    verdicts = ColumnSteps().score(items)
    assert [v.rewards["process"] for v in verdicts] == [1.0, 0.0]
    assert verdicts[1].info == "step 0 wrong"


class Halves(ProcessVerifier):
    """A plug-in: the second half of any response is the wrong step."""

    def __init__(self, cfg):
        pass

    def first_error(self, response, problem):
        return StepFix(1, len(response) // 2, "ok") if response else None


def test_a_plug_in_is_chosen_by_dotted_path_and_a_misspelt_name_fails_at_config_time():
    cfg = load_config(None, [f"generate.scope.verifier={__name__}:Halves"])
    v = build_process_verifier(cfg.generate.scope.verifier, cfg)
    assert v.first_error("abcd", P) == StepFix(1, 2, "ok")
    with pytest.raises(Exception, match="generate.scope.verifier.*colums.*columns"):
        load_config(None, ["generate.scope.verifier=colums"])
    assert "columns" in registry.names("process_verifier")
