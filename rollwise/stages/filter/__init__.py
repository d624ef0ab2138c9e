"""Filter stage: turn a finished response into reward channels, with the reason.

`make_scorer(name, task)` returns score(response_text, problem) -> (reward, info). Built in:
'exact' (the task's extracted answer equals the reference), 'math_verify' (symbolic
equivalence), or a user's function 'package.module:function' with that same signature.
A scorer that raises marks the sample failed; the run goes on.
"""

from __future__ import annotations

import importlib
from typing import Callable

from rollwise.tasks import Problem, Task

Scorer = Callable[[str, Problem], tuple[float, str]]


def exact_scorer(task: Task) -> Scorer:
    def score(response: str, problem: Problem) -> tuple[float, str]:
        got = task.extract_answer(response)
        return (1.0 if got is not None and got.strip() == problem.answer.strip() else 0.0), \
            f"answer={got!r}"
    return score


def math_verify_scorer(task: Task) -> Scorer:
    from math_verify import parse, verify

    def score(response: str, problem: Problem) -> tuple[float, str]:
        got = task.extract_answer(response)
        if got is None:
            return 0.0, "no answer found"
        # timeouts off: math-verify's signal.alarm only works in the main thread
        gold = parse(problem.answer, parsing_timeout=None)
        pred = parse(got, parsing_timeout=None)
        return float(verify(gold, pred, timeout_seconds=None)), f"answer={got!r}"
    return score


def import_object(path: str):
    if ":" not in path:
        raise ValueError(f"{path!r}: name a user function as 'package.module:function'")
    module, name = path.split(":", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e


def make_scorer(name: str, task: Task) -> Scorer:
    if task.score_fn is not None and name == "exact":
        fn = task.score_fn
        return lambda response, problem: (float(fn(response, problem)), "task scorer")
    if name == "exact":
        return exact_scorer(task)
    if name == "math_verify":
        return math_verify_scorer(task)
    user = import_object(name)

    def score(response: str, problem: Problem) -> tuple[float, str]:
        out = user(response, problem)
        reward, info = out if isinstance(out, tuple) else (out, "")
        return float(reward), str(info)
    return score


class FilterStage:
    """Scores whole groups of samples in place (minimal in-process version; see issue 5)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def score(self, samples, problems: list[Problem], texts: list[str]) -> dict[str, float]:
        from rollwise.types import Status
        failed: dict[str, float] = {}
        for s, p, text in zip(samples, problems, texts):
            try:
                reward, info = self.scorer(text, p)
            except Exception as e:  # one bad sample never stops the run
                s.status, reward, info = Status.FAILED, 0.0, f"{type(e).__name__}: {e}"
                key = f"filter/failed/{type(e).__name__}"
                failed[key] = failed.get(key, 0.0) + 1
            s.rewards = {"reward": float(reward)}
            s.reward, s.reward_info = float(reward), info
        return failed


def build_filter(cfg, task: Task) -> FilterStage:
    return FilterStage(make_scorer(cfg.reward, task))
