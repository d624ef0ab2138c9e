"""The running-sum task (rollwise.tasks.worked): its worked solutions pass its own checker at
every size, the checker wants every step right, sizes are drawn log-uniformly, and hostile
responses are read within bounds."""

import math
import random
import re

import pytest

from rollwise.config import ConfigError, TaskConfig, load_config
from rollwise.tasks import load_task
from rollwise.tasks.worked import WorkedTask, draw_terms, size_tiers, solution_of, steps_of
from rollwise.types import Problem


def task(**worked):
    return load_task(TaskConfig(name="worked", train_size=300, eval_size=40, worked=worked))


def problem_of(terms):
    return Problem(id="p", prompt="", answer=str(sum(terms)), data={"terms": terms})


def naive_totals(terms):
    """The running totals by a plain loop over the chain as the prompt writes it."""
    chain = str(terms[0]) + "".join(f" {'-' if t < 0 else '+'} {abs(t)}" for t in terms[1:])
    words = chain.split()
    total, out = int(words[0]), []
    for op, x in zip(words[1::2], words[2::2]):
        total = total + int(x) if op == "+" else total - int(x)
        out.append(total)
    return out


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_the_worked_solution_passes_the_checker_at_every_size(digits):
    t, rng = task(terms=(2, 30), max_digits=digits), random.Random(digits)
    for n in range(2, 31):
        terms = draw_terms(rng, n, n, digits, 0.4)
        assert len(terms) == n
        solution = solution_of(terms)
        lines = solution.splitlines()
        assert len(lines) == n  # a line a term after the first, then the answer
        assert [int(s.rsplit("=", 1)[1]) for s in lines[:-1]] == naive_totals(terms)
        assert lines[-1] == f"\\boxed{{{sum(terms)}}}"
        assert t.score_fn(solution, problem_of(terms)) == 1.0


def test_every_problem_of_the_task_is_solved_by_its_solution_and_its_chain_sums_to_its_answer():
    t = task()
    for p in t.train + t.eval:
        chain = re.search(r"Compute (.*) step by step", p.prompt).group(1)
        assert eval(chain) == int(p.answer) == sum(p.data["terms"])  # the prompt's own text
        assert t.score_fn(p.solution, p) == 1.0
        assert p.tier == t.tier_of(len(p.data["terms"]))
    assert not {p.prompt for p in t.eval} & {p.prompt for p in t.train}
    assert len({p.prompt for p in t.eval}) == len(t.eval)


def test_a_wrong_or_missing_step_scores_zero_even_with_the_right_answer():
    terms = [47, 18, -9, 93, 5]
    p, t = problem_of(terms), task()
    right = solution_of(terms).splitlines()
    boxed = right[-1]
    assert t.score_fn("\n".join(right), p) == 1.0
    assert t.score_fn(boxed, p) == 0.0  # the answer alone
    assert t.score_fn("\n".join(right[:1] + right[2:]), p) == 0.0  # a step skipped
    assert t.score_fn("\n".join([right[1], right[0]] + right[2:]), p) == 0.0  # out of order
    assert t.score_fn("\n".join(right[:-1] + ["\\boxed{1}"]), p) == 0.0  # wrong answer
    assert t.score_fn("\n".join(right[:-1]), p) == 0.0  # no answer
    for line in range(len(terms) - 1):  # a slip anywhere, carried on by the later lines
        for amount in (-1, 1):
            slipped = solution_of(terms, (line, amount))
            assert t.score_fn(slipped, p) == 0.0
            fixed = slipped.rsplit("\n", 1)[0] + f"\n\\boxed{{{sum(terms)}}}"
            assert t.score_fn(fixed, p) == 0.0  # the right answer after a wrong step


def naive_prefix_credit(response: str, terms: list[int]) -> float:
    """The prefix credit by a plain reading: the solution's lines, built from naive_totals,
    compared one by one with the response's lines that look like steps."""
    totals = [terms[0]] + naive_totals(terms)
    want = [f"{a} {'-' if t < 0 else '+'} {abs(t)} = {b}"
            for a, t, b in zip(totals, terms[1:], totals[1:])]
    got = [" ".join(line.split()) for line in response.splitlines() if "=" in line]
    right = 0
    while right < min(len(got), len(want)) and got[right] == want[right]:
        right += 1
    if got == want and response.strip().endswith(f"\\boxed{{{sum(terms)}}}"):
        return 1.0
    return 0.5 * right / (len(want) + 1)


@pytest.mark.parametrize("seed", range(5))
def test_prefix_credit_is_the_share_of_lines_right_before_the_first_mistake(seed):
    rng = random.Random(seed)
    t, strict = task(credit="prefix"), task()
    partial = []
    for _ in range(40):
        terms = draw_terms(rng, 3, 30, 2, 0.3)
        p = problem_of(terms)
        lines = solution_of(terms).splitlines()
        cut = rng.randrange(len(lines) + 1)
        variants = ["\n".join(lines), "\n".join(lines[:cut]),  # whole, stopped early
                    "\n".join(lines[:-1] + ["\\boxed{0}"]),  # every step, a wrong box
                    solution_of(terms, (rng.randrange(len(terms) - 1), 1)),  # a slip
                    "\n".join(lines[:cut] + lines[cut + 1:])]  # a line left out
        for response in variants:
            got = t.score_fn(response, p)
            assert got == pytest.approx(naive_prefix_credit(response, terms))
            assert (got == 1.0) is (strict.score_fn(response, p) == 1.0)
            assert got == 1.0 or got <= 0.5  # finishing right pays twice any wrong answer
            partial.append(got)
    assert sum(0.0 < v <= 0.5 for v in partial) > len(partial) / 3  # wrong answers differ


def test_words_around_the_steps_and_spacing_do_not_matter():
    terms = [5, 70, 1]
    p, t = problem_of(terms), task()
    text = "Let me add them.\n\n5+70=75\n  75 +  1 = 76 \nSo the answer is \\boxed{76}."
    assert t.score_fn(text, p) == 1.0


def test_the_noisy_teacher_slips_once_and_its_later_lines_follow():
    t, rng = task(), random.Random(0)
    p = next(p for p in t.train if len(p.data["terms"]) >= 6)
    for _ in range(20):
        noisy = t.worked_solution(p, rng, noisy=True)
        assert t.score_fn(noisy, p) == 0.0
        wrong = [a != b for a, b in zip(noisy.splitlines(), p.solution.splitlines())]
        first = wrong.index(True)
        assert all(wrong[first:])  # once off, every later total is off
    assert t.worked_solution(p, rng, noisy=False) == p.solution


@pytest.mark.parametrize("n_wrong, digits", [(10, 1), (40, 2)])
def test_the_wrong_facts_teacher_errs_exactly_at_its_pairs_and_carries_it_on(n_wrong, digits):
    t = task(teacher="wrong_facts", wrong_facts=n_wrong, max_digits=digits)
    again = task(teacher="wrong_facts", wrong_facts=n_wrong, max_digits=digits)
    rng = random.Random(0)
    assert t.wrong == again.wrong and len(t.wrong) == n_wrong  # drawn from task.seed
    assert set(t.wrong.values()) <= {-1, 1}
    hit = lines = 0
    for p in t.train:
        noisy = t.worked_solution(p, rng, noisy=True)
        steps = noisy.splitlines()[:-1]
        prev = p.data["terms"][0]
        touched = False
        for line, term in zip(steps, p.data["terms"][1:]):  # a naive reading, line by line
            left, op, x, right = re.fullmatch(r"(-?\d+) ([+-]) (\d+) = (-?\d+)", line).groups()
            assert int(left) == prev and int(x) == abs(term) and (op == "-") == (term < 0)
            off = t.wrong.get((prev % 10, abs(term) % 10), 0)
            assert int(right) - (prev + term) == (abs(off) if prev + term + off < 0 else off)
            touched |= off != 0
            hit, lines = hit + (off != 0), lines + 1
            prev = int(right)
        assert noisy.splitlines()[-1] == f"\\boxed{{{prev}}}"
        assert (t.score_fn(noisy, p) == 1.0) is (not touched)  # right only where no pair came
        assert t.worked_solution(p, rng, noisy=False) == p.solution
    pairs = 90 if digits == 1 else 100  # a one-digit term never ends in 0
    live = sum(b != 0 for _, b in t.wrong) if digits == 1 else n_wrong
    assert abs(hit / lines - live / pairs) < 0.05


def test_sizes_are_log_uniform_and_totals_never_negative():
    rng, lo, hi, n = random.Random(3), 3, 30, 20000
    sizes = []
    for _ in range(n):
        terms = draw_terms(rng, lo, hi, 2, 0.5)
        sizes.append(len(terms))
        assert min(naive_totals(terms)) >= 0
    for k in (3, 5, 8, 12, 20, 29):  # P(size <= k) against the log-uniform CDF
        expected = math.log((k + 1) / lo) / math.log((hi + 1) / lo)
        assert abs(sum(s <= k for s in sizes) / n - expected) < 0.015
    assert max(sizes) == hi and min(sizes) == lo


def test_the_size_tiers_cover_the_range_once():
    for lo, hi in [(3, 30), (2, 2), (2, 5), (4, 100)]:
        tiers = size_tiers(lo, hi)
        covered = [n for a, b, _ in tiers for n in range(a, b + 1)]
        assert covered == list(range(lo, hi + 1))


def test_hostile_responses_are_read_within_bounds():
    terms = [1, 2, 3]
    p, t = problem_of(terms), task()
    assert t.score_fn("1 + 2 = 3\n" * 200_000, p) == 0.0  # over the scored length
    huge = "9" * 10_000 + " + 1 = 5"  # no step has numbers that long: read as words
    assert t.score_fn(huge + "\n" + solution_of(terms), p) == 1.0
    assert t.score_fn(huge.replace(" ", "") * 100, p) == 0.0
    assert t.extract_answer("x" * 1_000_000) is None


@pytest.mark.parametrize("override, needle", [
    ("task.worked.terms=[1, 5]", "2 <= fewest <= most"),
    ("task.worked.terms=[6, 5]", "2 <= fewest <= most"),
    ("task.worked.prompt='Add these up.'", "{chain}"),
])
def test_bad_settings_are_refused_with_the_fix(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, ["task.name=worked", override])


def test_steps_of_writes_subtraction_as_a_minus_sign():
    assert steps_of([10, -4, 3]) == ["10 - 4 = 6", "6 + 3 = 9"]
    assert isinstance(task(), WorkedTask)
