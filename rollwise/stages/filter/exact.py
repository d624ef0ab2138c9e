"""Cheap in-process verifiers that compare with the reference answer.

exact: the extracted answer equals the problem's answer (whitespace-stripped strings).
task:  the task's own scorer (reasoning-gym tasks bring one), fed the raw response.
"""

from __future__ import annotations

from rollwise.stages.filter.base import Item, Verdict, Verifier


class ExactVerifier(Verifier):
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


class EnvRewardVerifier(Verifier):
    """An agent episode's reward, as its environment gave it (rollwise.agents.episode);
    an environment that failed fails the sample with its reason."""

    isolated = False
    name = "env"

    def score(self, items: list[Item]) -> list[Verdict]:
        out = []
        for it in items:
            if "env_error" in it.meta:
                out.append(Verdict.failure("env_error", it.meta["env_error"]))
            elif "env_reward" not in it.meta:
                out.append(Verdict.failure("env_error", "not an agent episode: filter.reward="
                                           "env needs generate.strategy=episode"))
            else:
                out.append(Verdict({self.name: float(it.meta["env_reward"])},
                                   f"turns={it.meta.get('turns')}"))
        return out

    def metrics(self) -> dict[str, float]:
        return {}


class TaskScoreVerifier(Verifier):
    """Delegates to `task.score_fn(response, problem)` (kept in-process: it holds the task)."""

    isolated = False

    def __init__(self, task, name: str = "exact"):
        self.fn, self.name = task.score_fn, name

    def score(self, items: list[Item]) -> list[Verdict]:
        return [Verdict({self.name: float(self.fn(it.text, it.problem))},
                        f"answer={it.answer!r} (task scorer)") for it in items]

    def metrics(self) -> dict[str, float]:
        return {}
