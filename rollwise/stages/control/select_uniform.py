"""Uniform prompt selection without replacement within a step."""

from __future__ import annotations

import random

from rollwise.stages.control.base import Selector
from rollwise.types import Problem


class UniformSelector(Selector):
    @classmethod
    def build(cls, cfg) -> "UniformSelector":
        return cls()

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        return rng.sample(pool, min(n, len(pool)))

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
