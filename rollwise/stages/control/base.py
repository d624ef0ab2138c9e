"""The prompt selector's base class; selectors are chosen by name through rollwise.registry."""

from __future__ import annotations

import abc
import random

from rollwise import registry
from rollwise.types import Problem


class Selector(abc.ABC):
    """Chooses prompts and learns from their outcomes. State is per prompt id and is saved
    with checkpoints (state_dict / load_state_dict)."""

    @abc.abstractmethod
    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]: ...

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """outcomes: prompt id -> (successes, trials) of its group at this step."""

    def metrics(self) -> dict[str, float]:
        """What the last selection decided, for the step's metrics (control/<name>/...)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build_selector(cfg) -> Selector:
    """The selector `control.selector` names (cfg: the run's Config): built-in, registered,
    or 'package.module:factory' called as factory(cfg)."""
    factory = registry.resolve("selector", cfg.control.selector, "control.selector")
    return registry.conform(factory(cfg), Selector, "control.selector")
