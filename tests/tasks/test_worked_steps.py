"""SCOPE's process verifier for the running-sum task (rollwise.tasks.worked.WorkedSteps): it
finds no wrong step exactly where the task's own scorer gives 1, the first wrong line it
finds is the first one a naive line-by-line comparison finds, and the response kept up to
it, with its correction and the reference's remaining lines, scores 1."""

import random

import pytest

from rollwise.bench.methods import arm_last
from rollwise.config import TaskConfig, load_config
from rollwise.stages.filter.process import build_process_verifier
from rollwise.tasks import load_task
from rollwise.tasks.worked import WorkedSteps, draw_terms, solution_of, steps_of
from rollwise.types import Problem

TASK = load_task(TaskConfig(name="worked", train_size=50, eval_size=10,
                            worked={"credit": "all"}))
VERIFY = WorkedSteps()


def problem_of(terms):
    return Problem(id="p", prompt="", answer=str(sum(terms)), data={"terms": terms})


def corrupt(lines: list[str], rng: random.Random) -> list[str]:
    """A response's lines with one of the mistakes a policy makes."""
    out, i = list(lines), rng.randrange(len(lines))
    kind = rng.choice(["total", "term", "drop", "extra", "box", "nobox", "cut", "words", "none"])
    if kind == "total" and i < len(lines) - 1:
        head, total = out[i].rsplit("= ", 1)
        out[i] = f"{head}= {int(total) + rng.choice((-1, 1, 10))}"
    elif kind == "term" and i < len(lines) - 1:
        out[i] = out[i].replace(" + ", " - ", 1) if " + " in out[i] else out[i].replace(
            " - ", " + ", 1)
    elif kind == "drop":
        del out[i]
    elif kind == "extra":
        out.insert(i, "3 + 4 = 7")
    elif kind == "box":
        out[-1] = "\\boxed{%d}" % rng.randint(0, 999)
    elif kind == "nobox":
        out = out[:-1]
    elif kind == "cut":
        text = "\n".join(out)
        return text[:rng.randrange(len(text) + 1)].split("\n")
    elif kind == "words":
        out.insert(i, "Next, carry the total on.")
    return out


def naive_first_wrong(lines: list[str], terms: list[int]) -> int | None:
    """The index of the first step line (or the box) that differs, by plain string comparison
    of the response's step-like lines with the reference's."""
    want = steps_of(terms)
    steps = [ln for ln in lines if ln and ln[0].isdigit() and "=" in ln]
    for k, (got, right) in enumerate(zip(steps, want)):
        if got != right:
            return k
    if len(steps) != len(want):
        return min(len(steps), len(want))
    box = "\\boxed{%d}" % sum(terms)
    return None if any(ln == box for ln in lines) and lines[-1] == box else len(want)


@pytest.mark.parametrize("seed", range(6))
def test_no_wrong_step_exactly_where_the_scorer_gives_one_and_the_fix_repairs(seed):
    rng = random.Random(seed)
    for _ in range(150):
        n = rng.randint(2, 36)
        terms = draw_terms(rng, n, n, rng.randint(1, 2), 0.4)
        problem, reference = problem_of(terms), solution_of(terms).split("\n")
        lines = corrupt(reference, rng)
        response = "\n".join(lines)
        fix = VERIFY.first_error(response, problem)
        assert (fix is None) == (TASK.score_fn(response, problem) == 1.0), response
        if fix is None:
            continue
        assert fix.step == naive_first_wrong(lines, terms), response
        kept = response[:fix.start]
        assert response.startswith(kept) and fix.text.strip()
        # the kept text, the correction, then the reference from the next step on
        rest = reference[fix.step + 1:] if fix.step < n - 1 else []
        repaired = kept + fix.text + "\n".join(rest)
        assert TASK.score_fn(repaired, problem) == 1.0, (response, fix)
        # a response of step lines only: kept + correction is the reference's beginning
        if all(ln[:1].isdigit() or ln.startswith("\\boxed") for ln in lines if ln):
            assert "\n".join(reference).startswith((kept + fix.text).rstrip("\n")), (response, fix)


def test_the_first_wrong_line_and_its_correction():
    terms = [47, 18, -9, 93]
    problem = problem_of(terms)
    right = "47 + 18 = 65\n65 - 9 = 56\n56 + 93 = 149\n\\boxed{149}"
    assert VERIFY.first_error(right, problem) is None
    assert VERIFY.first_error("Sure.\n" + right + "\nDone.", problem) is None
    wrong = "47 + 18 = 65\n65 - 9 = 57\n57 + 93 = 150\n\\boxed{150}"
    fix = VERIFY.first_error(wrong, problem)
    assert (fix.step, fix.start, fix.text) == (1, 13, "65 - 9 = 56\n")
    # every line right, the box wrong: the box is the step, on a line of its own
    fix = VERIFY.first_error("47 + 18 = 65\n65 - 9 = 56\n56 + 93 = 149", problem)
    assert (fix.step, fix.start, fix.text) == (3, 38, "\n\\boxed{149}")
    # stopped early: the next line follows the last right one
    fix = VERIFY.first_error("47 + 18 = 65\n", problem)
    assert (fix.step, fix.start, fix.text) == (1, 13, "65 - 9 = 56\n")


def test_another_task_s_problem_is_not_checked():
    assert VERIFY.first_error("1 + 1 = 3", Problem(id="q", prompt="1+1=", answer="2")) is None


def test_the_scope_arm_uses_it_on_the_worked_task():
    cfg = load_config("configs/smollm2-long.yaml", ["generate.scope.verifier=worked"],
                      check_files=False)  # the model need not be fetched to read it
    assert isinstance(build_process_verifier(cfg.generate.scope.verifier, cfg), WorkedSteps)
    assert arm_last("scope", "configs/smollm2-long.yaml", []) == [
        "generate.scope.verifier=worked"]
    assert arm_last("scope", "configs/smollm2.yaml", []) == ["generate.scope.verifier=equations"]
