"""Code verifier on real programs: pass, wrong answer, crash, timeout, assert-style tests,
and the share-of-tests mode; through the Filter stage and its worker pool."""

from __future__ import annotations

import pytest

from rollwise.config import FilterConfig, TaskConfig
from rollwise.stages.filter import build_filter
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.code_verifier import CodeVerifier, extract_code, same_output
from rollwise.stages.filter.sandbox import SandboxLimits
from rollwise.tasks import Problem, load_task
from rollwise.types import Sample, Status

# sum of the numbers on each line; the reference outputs are computed here, in the test
CASES = [[1, 2, 3], [10, -4], [7], [100, 200, 300, 400]]
TESTS = [{"input": " ".join(map(str, c)) + "\n", "output": f"{sum(c)}\n"} for c in CASES]
SUM = Problem("sum", "Sum the numbers on stdin.", "", data={"tests": TESTS})
FIB = Problem("fib", "Write fib(n).", "", data={
    "test_code": "\n".join(f"assert fib({n}) == {v}" for n, v in
                           [(0, 0), (1, 1), (2, 1), (10, 55), (20, 6765)])})

GOOD_SUM = "print(sum(map(int, input().split())))"
CRASH = "raise SystemExit(1 / 0)"
LOOP = "while True:\n    pass"
GOOD_FIB = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
            "        a, b = b, a + b\n    return a")
OFF_BY_ONE_FIB = GOOD_FIB.replace("range(n)", "range(n + 1)")
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=1)


def score(code: str, problem: Problem, mode: str = "all"):
    text = f"Here you go:\n```python\n{code}\n```\n"
    return CodeVerifier(LIMITS, mode).score([Item(text, problem)])[0]


def test_correct_program_passes_every_test():
    v = score(GOOD_SUM, SUM)
    assert v.rewards == {"code": 1.0} and v.info == f"passed {len(TESTS)}/{len(TESTS)}"


def test_wrong_answer_fails_with_the_first_difference():
    v = score("print(sum(map(int, input().split())) + 1)", SUM)
    assert v.rewards == {"code": 0.0}
    assert "test 1: wrong output '7\\n', expected '6\\n'" in v.info


def test_only_some_cases_right_scores_the_share_in_fraction_mode():
    code = "xs = list(map(int, input().split()))\nprint(sum(xs) if len(xs) > 2 else 0)"
    want = sum(len(c) > 2 for c in CASES) / len(CASES)  # reference: which cases it gets right
    assert score(code, SUM, "fraction").rewards == {"code": pytest.approx(want)}
    assert score(code, SUM, "all").rewards == {"code": 0.0}


def test_crash_and_timeout_are_wrong_answers_with_reasons_not_failures():
    crash = score(CRASH, SUM)
    assert crash.failed is None and crash.rewards == {"code": 0.0}
    assert "ZeroDivisionError" in crash.info
    loop = score(LOOP, SUM)
    assert loop.failed is None and loop.rewards == {"code": 0.0}
    assert "cpu_time" in loop.info or "timeout" in loop.info


def test_assert_style_tests():
    assert score(GOOD_FIB, FIB).rewards == {"code": 1.0}
    bad = score(OFF_BY_ONE_FIB, FIB)
    assert bad.rewards == {"code": 0.0} and "AssertionError" in bad.info


def test_problem_without_tests_is_a_verifier_error():
    with pytest.raises(ValueError, match="no 'tests' or 'test_code'"):
        score(GOOD_SUM, Problem("x", "q", "1"))


def test_code_extraction_and_output_comparison():
    assert extract_code("a\n```python\nx=1\n```\nb\n```py\ny=2\n```") == "y=2\n"
    assert extract_code("print(1)") == "print(1)"  # no fence: the whole response
    assert same_output("1 \n2\n\n", "1\n2") and not same_output("1\n2", "1\n3")


def test_code_reward_through_the_stage_and_pool():
    task = load_task(TaskConfig(train_size=20, eval_size=8))
    problems = [SUM, SUM, FIB, FIB]
    texts = [f"```python\n{c}\n```" for c in (GOOD_SUM, CRASH, GOOD_FIB, OFF_BY_ONE_FIB)]
    samples = [Sample(prompt_id=p.id, prompt_ids=[1], group_id=p.id, status=Status.COMPLETED)
               for p in problems]
    stage = build_filter(FilterConfig(reward="code", workers=2, timeout_s=30,
                                      sandbox={"timeout_s": 2.0, "cpu_s": 1}), task)
    try:
        m = stage.score(samples, problems, texts)
    finally:
        stage.close()
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert m["filter/failed"] == 0 and all(s.status == Status.COMPLETED for s in samples)
