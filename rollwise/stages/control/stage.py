"""The Control stage: where compute goes. Which prompts (a Selector over the pool, which a
curriculum hook may narrow), how many generation rounds a step takes (Refill: DAPO dynamic
sampling), and what happens to requests in flight (an InflightController: APRIL, ...).

    control = Control(cfg, task)
    for n in control.rounds(want, kept):          # one round, or refills until `want` are kept
        problems = control.select(k, step, ledger)
    kept = control.trim(kept, want, ledger)
    control.observe(scored, step)                 # selectors and curricula learn from outcomes
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from rollwise.stages.control.base import build_selector
from rollwise.stages.control.inflight import build_inflight
from rollwise.stages.ledger import Ledger
from rollwise.stages.replay.curriculum import build_curriculum
from rollwise.tasks import Problem
from rollwise.types import Group


class Refill:
    """DAPO dynamic sampling as a Control policy: without it a step has one round of `want`
    groups; with it, rounds go on (control.max_rounds at most) until `want` groups are kept,
    each generating the groups still missing (refill=missing) or a whole batch again
    (refill=full, as verl's DAPO recipe)."""

    def __init__(self, cfg):
        c = cfg.control
        self.rounds_max = c.max_rounds if c.dynamic_sampling else 1
        self.full = c.refill == "full"

    def rounds(self, want: int, kept: list[Group]) -> Iterator[int]:
        """Groups to generate in each round; reads `kept` as the caller fills it."""
        for _ in range(self.rounds_max):
            if len(kept) >= want:
                return
            yield want if self.full else want - len(kept)

    @staticmethod
    def trim(kept: list[Group], want: int, ledger: Ledger) -> list[Group]:
        """A step trains on exactly `want` groups; kept ones beyond are dropped as batch_full."""
        for g in kept[want:]:
            ledger.decide("filter", "drop", "batch_full")
            ledger.tokens_to("filtered/batch_full", sum(s.num_tokens for s in g.samples))
        return kept[:want]


class Control:
    def __init__(self, cfg, task, rng: random.Random):
        self.cfg, self.task, self.rng = cfg, task, rng
        self.selector = build_selector(cfg)
        self.curriculum = build_curriculum(cfg.replay)
        self.inflight = build_inflight(cfg)
        self.refill = Refill(cfg)

    def rounds(self, want: int, kept: list[Group]) -> Iterator[int]:
        return self.refill.rounds(want, kept)

    def trim(self, kept: list[Group], want: int, ledger: Ledger) -> list[Group]:
        return self.refill.trim(kept, want, ledger)

    def select(self, n: int, step: int, ledger: Ledger) -> list[Problem]:
        if n == 0:
            return []
        ledger.decide("control", "select", self.cfg.control.selector, n)
        pool = self.task.train if self.curriculum is None \
            else self.curriculum.pool(self.task.train, step)
        return self.selector.select(pool, n, self.rng)

    def observe(self, scored: list[Group], step: int) -> None:
        """Every scored group, kept or not: (successes, trials) per prompt."""
        outcomes = {g.prompt_id: (sum(r >= 1.0 for r in g.rewards), len(g.samples))
                    for g in scored}
        self.selector.observe(outcomes, step)
        if self.curriculum is not None:
            self.curriculum.observe(outcomes, step)

    def parts(self) -> dict:
        """The stateful parts, for checkpoints."""
        return {"selector": self.selector, "inflight": self.inflight,
                "curriculum": self.curriculum}
