"""Cheap in-process verifiers that compare with the reference answer.

exact: the extracted answer equals the problem's answer (whitespace-stripped strings).
task:  the task's own scorer (reasoning-gym tasks bring one), fed the raw response.
"""

from __future__ import annotations

from rollwise.stages.filter.base import Item, Verdict


class ExactVerifier:
    isolated = False

    def __init__(self, name: str = "exact"):
        self.name = name

    def score(self, items: list[Item]) -> list[Verdict]:
        out = []
        for it in items:
            hit = it.answer is not None and it.answer.strip() == it.problem.answer.strip()
            out.append(Verdict({self.name: float(hit)}, f"answer={it.answer!r}"))
        return out

    def metrics(self) -> dict[str, float]:
        return {}


class TaskScoreVerifier:
    """Delegates to `task.score_fn(response, problem)` (kept in-process: it holds the task)."""

    isolated = False

    def __init__(self, task, name: str = "exact"):
        self.fn, self.name = task.score_fn, name

    def score(self, items: list[Item]) -> list[Verdict]:
        return [Verdict({self.name: float(self.fn(it.text, it.problem))},
                        f"answer={it.answer!r} (task scorer)") for it in items]

    def metrics(self) -> dict[str, float]:
        return {}
