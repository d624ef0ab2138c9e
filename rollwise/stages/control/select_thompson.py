"""MoPPS-style Beta-Bernoulli Thompson sampling (Qu et al. 2025, "Can Prompt Difficulty be
Online Predicted for Accelerating RL Finetuning of Reasoning Models?").

Each prompt keeps Beta(a, b) counts of successes and failures, decayed toward the prior
Beta(1, 1) by `decay` every time it is observed. Selection draws theta ~ Beta(a, b) for each
prompt of the pool and takes the n closest to the target success rate (0.5: the most
informative group for GRPO).
"""

from __future__ import annotations

import random

from rollwise.stages.control.base import Selector
from rollwise.types import Problem


class ThompsonSelector(Selector):
    @classmethod
    def build(cls, cfg) -> "ThompsonSelector":
        c = cfg.control.thompson
        return cls(target=c.target_success, decay=c.decay)

    def __init__(self, target: float = 0.5, decay: float = 1.0):
        self.target, self.decay = target, decay
        self.counts: dict[str, list[float]] = {}  # prompt id -> [a, b]

    def posterior(self, pid: str) -> tuple[float, float]:
        a, b = self.counts.get(pid, (1.0, 1.0))
        return a, b

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        scored = [(abs(rng.betavariate(*self.posterior(p.id)) - self.target), i)
                  for i, p in enumerate(pool)]
        return [pool[i] for _, i in sorted(scored)[:n]]

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """outcomes: prompt id -> (successes, trials) of its group."""
        for pid, (succ, trials) in outcomes.items():
            a, b = self.posterior(pid)
            d = self.decay
            self.counts[pid] = [d * a + (1 - d) + succ, d * b + (1 - d) + trials - succ]

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: list(v) for k, v in state["counts"].items()}
