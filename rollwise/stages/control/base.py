"""The prompt-selector protocol and its registry."""

from __future__ import annotations

import random
from typing import Protocol

from rollwise.tasks import Problem


class Selector(Protocol):
    """Chooses prompts and learns from their outcomes. State is per prompt id and is saved
    with checkpoints (state_dict / load_state_dict)."""

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]: ...

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """outcomes: prompt id -> (successes, trials) of its group at this step."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def build_selector(cfg) -> Selector:
    """cfg: ControlConfig."""
    name = cfg.selector
    if name == "uniform":
        from rollwise.stages.control.select_uniform import UniformSelector
        return UniformSelector()
    if name == "thompson":
        from rollwise.stages.control.select_thompson import ThompsonSelector
        return ThompsonSelector(target=cfg.target_success, decay=cfg.decay)
    if name == "dps":
        from rollwise.stages.control.select_dps import DPSSelector
        return DPSSelector(decay=cfg.decay, candidate_ratio=cfg.candidate_ratio,
                           prior_name=cfg.dps_prior)
    raise ValueError(f"control.selector = {name!r}: choose uniform, thompson or dps")
