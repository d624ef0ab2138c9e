"""Running sums written step by step: a long-answer task for a real chat model.

    task.name=worked task.worked.terms='[3, 30]'

A problem is a chain of 3 to 30 integers added and subtracted ("Compute 47 + 18 - 9 + 93 step
by step"); its worked solution writes the running total one line per term, then the answer:

    47 + 18 = 65
    65 - 9 = 56
    56 + 93 = 149
    \\boxed{149}

so a response's length follows the problem's size (about 13 tokens a line with SmolLM2's
digit-per-token vocabulary), and the task's scorer gives 1 only when every step line is there,
in order, and right, and the boxed answer is the sum: a right answer reached by skipped or
wrong steps scores 0 (task.worked.credit=prefix gives a wrong answer half the share of lines
it got right before its first mistake). The number of terms is log-uniform over
task.worked.terms, so lengths are long-tailed (most chains short, some very long); a
problem's tier is its size bucket.
The noisy teacher (sft.noise of the solutions) writes a total off by one and carries it on:
once, at a random line (task.worked.teacher=slip: the warm start is unsure at single steps),
or after every line whose total and term end in one of task.worked.wrong_facts digit pairs
(teacher=wrong_facts: the warm start writes those sums wrong most of the time, and RL has
facts to relearn one by one, over many steps).
"""

from __future__ import annotations

import math
import random
import re

from rollwise.config import TaskConfig
from rollwise.stages.filter.process import ProcessVerifier, StepFix
from rollwise.tasks.arith import wrong_facts
from rollwise.tasks.base import Task, draw_unique
from rollwise.tasks.extract import last_boxed
from rollwise.types import Problem

# credit=prefix pays a wrong answer at most this: with the whole share (every step right,
# then more lines or no box: 0.97 of a 36-term chain) answers stopped ending, and truncations
# rose from 3 % to 23 % of a step's samples within 20 steps
PREFIX_CEILING = 0.5
MAX_SCORED_CHARS = 20_000  # a longer response is read no further (the scorer runs in-process)
STEP_LINE = re.compile(r"^\s*(-?\d{1,12})\s*([+-])\s*(\d{1,12})\s*=\s*(-?\d{1,13})\s*$")


Wrong = dict[tuple[int, int], int]


def slipped_total(right: int, off: int) -> int:
    """The total a teacher off by `off` writes: never taken below 0 by its own slip (it goes
    up instead), so a solution stays one a reader of step lines can follow."""
    return right + (abs(off) if right + off < 0 else off)


def steps_of(terms: list[int], slip: tuple[int, int] | None = None,
             wrong: Wrong | None = None) -> list[str]:
    """The step lines 'total op term = new total'; a negative term is subtracted. slip =
    (line, amount): that line's total is off by `amount`; wrong = {(total's last digit,
    term's last digit): amount}: every line with such a pair is off by it (slipped_total).
    Later lines carry the wrong total on, below 0 if they must ('8 - 9 = -1')."""
    lines, total = [], terms[0]
    for i, t in enumerate(terms[1:]):
        off = (slip[1] if slip and slip[0] == i else 0) + \
            (wrong.get((total % 10, abs(t) % 10), 0) if wrong else 0)
        new = slipped_total(total + t, off)
        lines.append(f"{total} {'-' if t < 0 else '+'} {abs(t)} = {new}")
        total = new
    return lines


def solution_of(terms: list[int], slip: tuple[int, int] | None = None,
                wrong: Wrong | None = None) -> str:
    lines = steps_of(terms, slip, wrong)
    final = int(lines[-1].rsplit("=", 1)[1])
    return "\n".join(lines + [f"\\boxed{{{final}}}"])


def draw_terms(rng: random.Random, lo: int, hi: int, max_digits: int,
               subtract: float) -> list[int]:
    """A chain of n terms, n log-uniform on [lo, hi]; each term has 1 to max_digits digits
    (uniform), and after the first is subtracted with probability `subtract` when the total
    stays >= 0."""
    n = min(hi, int(lo * math.exp(rng.random() * math.log((hi + 1) / lo))))
    terms, total = [], 0
    for i in range(n):
        d = rng.randint(1, max_digits)
        t = rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1)
        if i and t <= total and rng.random() < subtract:
            t = -t
        terms.append(t)
        total += t
    return terms


def size_tiers(lo: int, hi: int) -> list[tuple[int, int, str]]:
    """Three size buckets splitting [lo, hi] geometrically (the draw's own scale)."""
    edges = [lo] + [round(lo * ((hi + 1) / lo) ** (k / 3)) for k in (1, 2)] + [hi + 1]
    return [(a, b - 1, f"terms{a}-{b - 1}") for a, b in zip(edges, edges[1:]) if b > a]


class WorkedTask(Task):
    def __init__(self, cfg: TaskConfig):
        w = cfg.worked
        self.tiers = size_tiers(*w.terms)
        self.credit = w.credit
        self.wrong = wrong_facts(w.wrong_facts, cfg.seed) if w.teacher == "wrong_facts" else None
        rng = random.Random(cfg.seed)
        seen: set[str] = set()
        self.eval = draw_unique(cfg.eval_size, self._drawer(rng, w, "eval"), seen, "eval",
                                "task worked")
        self.train = draw_unique(cfg.train_size, self._drawer(rng, w, "train"), seen,
                                 "train", "task worked")

    def _drawer(self, rng: random.Random, w, split: str):
        def draw(i: int) -> Problem:
            terms = draw_terms(rng, *w.terms, w.max_digits, w.subtract)
            chain = str(terms[0]) + "".join(f" {'-' if t < 0 else '+'} {abs(t)}"
                                            for t in terms[1:])
            return Problem(id=f"{split}-{i}", prompt=w.prompt.replace("{chain}", chain),
                           answer=str(sum(terms)), tier=self.tier_of(len(terms)),
                           solution=solution_of(terms), data={"terms": terms})
        return draw

    def tier_of(self, n: int) -> str:
        return next(name for a, b, name in self.tiers if a <= n <= b)

    def worked_solution(self, problem: Problem, rng: random.Random, noisy: bool) -> str:
        if not noisy:
            return problem.solution
        terms = problem.data["terms"]
        if self.wrong:
            return solution_of(terms, wrong=self.wrong)
        return solution_of(terms, (rng.randrange(len(terms) - 1), rng.choice((-1, 1))))

    def extract_answer(self, response: str) -> str | None:
        return last_boxed(response[-MAX_SCORED_CHARS:])

    def score_fn(self, response: str, problem: Problem) -> float:
        """1 when the response's step lines are exactly the chain's running totals, in order,
        and the boxed answer is the sum; other lines (words, blank lines) are ignored. Under
        credit=prefix a response short of that scores the share of the solution's lines (steps
        then box) it wrote right before its first wrong, missing or extra line, times
        PREFIX_CEILING."""
        if len(response) > MAX_SCORED_CHARS:
            return 0.0
        written = [m.groups() for m in map(STEP_LINE.match, response.splitlines()) if m]
        expected = [STEP_LINE.match(s).groups() for s in steps_of(problem.data["terms"])]
        if written == expected and self.extract_answer(response) == problem.answer:
            return 1.0
        if self.credit == "all":
            return 0.0
        right = next((i for i, (w, e) in enumerate(zip(written, expected)) if w != e),
                     min(len(written), len(expected)))
        return PREFIX_CEILING * right / (len(expected) + 1)


class WorkedSteps(ProcessVerifier):
    """SCOPE's process verifier for this task (generate.scope.verifier=worked): the step
    lines of a response read as the scorer reads them, in order; the first that is not the
    chain's running total at its place (or one too many) is the first wrong step, and the
    correction is the right line. All steps right and the box wrong or missing: the box is
    the wrong step. None exactly when the scorer gives 1 (on the scorer's first
    MAX_SCORED_CHARS); a problem of another task (no terms) is not checked."""

    def __init__(self, cfg=None):
        pass

    def first_error(self, response: str, problem: Problem) -> StepFix | None:
        terms = (problem.data or {}).get("terms")
        if not terms:
            return None
        text = response[:MAX_SCORED_CHARS]
        expected = steps_of(terms)
        wanted = [STEP_LINE.match(s).groups() for s in expected]
        box = f"\\boxed{{{sum(terms)}}}"
        step, after = 0, 0  # steps read so far; where the text after the last one begins
        pos = 0
        for line in text.splitlines(keepends=True):
            m = STEP_LINE.match(line)
            if m:
                if step == len(expected):
                    return StepFix(step, pos, box)
                if m.groups() != wanted[step]:
                    return StepFix(step, pos, expected[step] + "\n")
                step, after = step + 1, pos + len(line)
            pos += len(line)
        # the last step line may end the response: what follows it starts on a new line
        lead = "\n" if after and text[after - 1] not in "\r\n" else ""
        if step < len(expected):
            return StepFix(step, after, lead + expected[step] + "\n")
        if last_boxed(text) != str(sum(terms)):
            return StepFix(step, after, lead + box)
        return None
