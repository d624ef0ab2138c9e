"""Math answers: symbolic equivalence with math-verify, and reasoning-gym's own scorers.

math-verify guards its parser and comparison with `signal.alarm`, which only works in a
process's main thread. In a pool worker we turn its timeouts off (the pool kills a worker
that overruns the per-sample timeout); in-process we keep them only on the main thread.
"""

from __future__ import annotations

import logging
import threading
from functools import lru_cache

from rollwise.stages.filter.base import Item, Verdict, Verifier
from rollwise.tasks.extract import is_number, numeric_literal
from rollwise.types import Problem


def _latex(answer: str) -> str:
    """math-verify extracts from LaTeX environments; wrap a bare answer so it parses as one."""
    s = answer.strip()
    return s if "$" in s or "\\boxed" in s or "\\(" in s else f"${s}$"


_WARM = Problem("warm", "", "\\frac{1}{2}")


class MathVerifier(Verifier):
    """1 when the extracted answer is mathematically equal to the reference (fractions,
    LaTeX, units, intervals, sets, equations, percentages), else 0. Where the reference is a
    plain number, the answer must state a number (extract.numeric_literal): math-verify would
    evaluate an expression, so restating the problem ('52 * 53 is the result of 52 * 53')
    would score as its answer, and RL learns to do exactly that."""

    name = "math"
    isolated = True

    def __init__(self, timeout_s: float = 5.0, name: str = "math"):
        self.timeout_s, self.name = timeout_s, name
        self.in_worker = False  # set by the pool: the pool's kill replaces math-verify's alarm

    def warm(self) -> None:
        """Import math-verify and sympy (seconds) before the first timed sample."""
        self.score([Item("1", _WARM, "1")])

    def _timeout(self) -> int | None:
        main = threading.current_thread() is threading.main_thread()
        return None if self.in_worker or not main else max(1, round(self.timeout_s))

    def score(self, items: list[Item]) -> list[Verdict]:
        return [self.score_one(it) for it in items]

    def score_one(self, it: Item) -> Verdict:
        if it.answer is None:
            return Verdict({self.name: 0.0}, "no answer found")
        from math_verify import verify  # math-verify: imported in the worker, not at start
        t = self._timeout()
        answer = it.answer
        if is_number(it.problem.answer):  # a numeric reference is matched by a stated value
            answer = numeric_literal(it.answer)
            if answer is None:
                return Verdict({self.name: 0.0}, f"answer={it.answer!r} (states no number; "
                               "an expression is not evaluated)")
        gold = _parse(_latex(it.problem.answer), t)
        pred = _parse(_latex(answer), t)
        if not pred:
            return Verdict({self.name: 0.0}, f"answer={it.answer!r} (not parseable)")
        ok = verify(gold, pred, timeout_seconds=t)
        return Verdict({self.name: float(ok)}, f"answer={it.answer!r}")

    def metrics(self) -> dict[str, float]:
        return {}


@lru_cache(maxsize=4096)
def _parse(text: str, timeout: int | None):

    # math-verify: imported in the scoring worker
    from math_verify import parse
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is off" warning
    return parse(text, parsing_timeout=timeout)


class GymVerifier(Verifier):
    """reasoning-gym's `score_answer(answer, entry)` of the dataset that made the problem
    (its name is in the entry's metadata), on the extracted answer."""

    name = "gym"
    isolated = True

    def __init__(self, name: str = "gym"):
        self.name = name
        self._scorers: dict = {}

    def score(self, items: list[Item]) -> list[Verdict]:
        return [self.score_one(it) for it in items]

    def score_one(self, it: Item) -> Verdict:
        entry = it.problem.data
        dataset = (entry.get("metadata") or {}).get("source_dataset")
        if not dataset:
            raise ValueError(f"problem {it.problem.id}: no metadata.source_dataset, so it is "
                             "not a reasoning-gym entry; use filter.reward=math or exact")
        if dataset not in self._scorers:
            # reasoning-gym: only for gym tasks
            import reasoning_gym
            self._scorers[dataset] = reasoning_gym.get_score_answer_fn(dataset)
        value = float(self._scorers[dataset](it.answer, entry))
        return Verdict({self.name: value}, f"answer={it.answer!r}")

    def metrics(self) -> dict[str, float]:
        return {}
