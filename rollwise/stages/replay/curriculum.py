"""Curriculum hook: the pool each step's prompts are selected from, reordered, cut or extended
from per-prompt statistics (trials, successes, last step seen) kept from every scored group.
They are the numbers the rollout store holds: `PromptStats.from_store` rebuilds them from it,
and they are saved with checkpoints.

    replay.curriculum = none | frontier | package.module:function

'frontier' keeps the `replay.curriculum_keep` share of the pool whose estimated success rate
(Beta(1, 1) posterior mean; unseen prompts 1/2) is closest to 1/2, so prompts known to be all
solved or all failed, whose groups carry no GRPO signal, are skipped while unseen prompts are
still explored (the idea behind skipping zero-variance prompts before rollout; DOTS targets
p = 1/2 the same way with a learned predictor). A user function is called as
fn(pool, stats, step) -> list[Problem] and may reorder or cut the pool, or add prompts it
generates (say, variants of prompts the policy keeps failing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rollwise.stages.filter.user import import_object
from rollwise.types import Problem


@dataclass
class PromptStat:
    trials: int = 0
    successes: int = 0
    last_step: int = -1

    @property
    def rate(self) -> float:
        """Posterior mean success rate under a uniform prior."""
        return (self.successes + 1) / (self.trials + 2)


class PromptStats:
    def __init__(self):
        self.by_prompt: dict[str, PromptStat] = {}

    def get(self, pid: str) -> PromptStat:
        return self.by_prompt.get(pid) or PromptStat()

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """outcomes: prompt id -> (successes, trials) of its group at `step`."""
        for pid, (succ, trials) in outcomes.items():
            s = self.by_prompt.setdefault(pid, PromptStat())
            s.trials, s.successes, s.last_step = s.trials + trials, s.successes + succ, step

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "PromptStats":
        """From rollout-store rows (prompt_id, step, reward): success means reward >= 1."""
        stats = cls()
        for r in sorted(rows, key=lambda r: r["step"]):
            stats.observe({r["prompt_id"]: (int(r["reward"] >= 1.0), 1)}, r["step"])
        return stats

    @classmethod
    def from_store(cls, store) -> "PromptStats":
        table = store.read().select(["prompt_id", "step", "reward"])
        return cls.from_rows(table.to_pylist())

    def state_dict(self) -> dict:
        return {pid: [s.trials, s.successes, s.last_step] for pid, s in self.by_prompt.items()}

    def load_state_dict(self, state: dict) -> None:
        self.by_prompt = {pid: PromptStat(*v) for pid, v in state.items()}


def frontier(pool: list[Problem], stats: PromptStats, step: int,
             keep: float = 0.25, target: float = 0.5) -> list[Problem]:
    """The `keep` share of the pool closest to the target success rate, in pool order among
    equals (so the result does not depend on dict or hash order)."""
    n = max(1, round(keep * len(pool)))
    ranked = sorted(range(len(pool)), key=lambda i: (abs(stats.get(pool[i].id).rate - target),
                                                     i))
    return [pool[i] for i in sorted(ranked[:n])]


class Curriculum:
    """Holds the per-prompt statistics and the hook that turns them into a pool."""

    def __init__(self, hook: Callable[[list[Problem], PromptStats, int], list[Problem]]):
        self.hook, self.stats = hook, PromptStats()

    def pool(self, pool: list[Problem], step: int) -> list[Problem]:
        out = self.hook(pool, self.stats, step)
        if not out:
            raise ValueError("replay.curriculum returned an empty pool; return at least the "
                             "prompts to select from")
        return out

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        self.stats.observe(outcomes, step)

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])


def build_curriculum(cfg) -> Curriculum | None:
    """cfg: ReplayConfig. None when replay.curriculum = 'none'."""
    name = cfg.curriculum
    if name == "none":
        return None
    if name == "frontier":
        keep = cfg.curriculum_keep
        return Curriculum(lambda pool, stats, step: frontier(pool, stats, step, keep))
    if ":" in name:
        try:
            return Curriculum(import_object(name))
        except ValueError as e:
            raise ValueError(f"replay.curriculum: {e}") from None
    raise ValueError(f"replay.curriculum = {name!r}: use 'none', 'frontier' or "
                     f"'package.module:function'")
