"""How many samples each prompt gets: a GroupSizer, chosen by `control.group_size`.

    fixed   every prompt gets generate.group_size (the GRPO default)
    sgpo    G = 1/p from a profiling pass (alloc_sgpo.py)
    dars    extra rollouts for hard prompts after the first ones are scored (alloc_dars.py)

Control asks the sizer for the pool it selects from (`pool`, once: sGPO profiles and filters
it there), for each selected prompt's size (`sizes`), and, after scoring, for the samples to
add to each group (`extra`). The size travels to the generator as Problem.group_size on a copy
of the pool's Problem; the trainer takes groups of any sizes (advantages are per group).
"""

from __future__ import annotations

import abc
from typing import Callable

from rollwise import registry
from rollwise.types import Group, Problem

# what a sizer's pool() gets: (problems, samples each) -> prompt id -> (successes, trials)
Profile = Callable[[list[Problem], int], dict[str, tuple[int, int]]]


class GroupSizer(abc.ABC):
    @abc.abstractmethod
    def sizes(self, problems: list[Problem], step: int) -> list[int]:
        """Samples for each selected prompt (0 skips it)."""

    def pool(self, pool: list[Problem], profile: Profile) -> list[Problem]:
        """The prompts to select from (called at every selection; cache what is costly)."""
        return pool

    def extra(self, groups: list[Group]) -> list[int]:
        """Samples to add to each scored group before training (0: none)."""
        return [0] * len(groups)

    def metrics(self) -> dict[str, float]:
        """What the last allocation decided, for the step's metrics (control/<name>/...)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FixedSize(GroupSizer):
    """control.group_size = fixed: generate.group_size for every prompt, nothing added."""

    def __init__(self, cfg):
        self.n = cfg.generate.group_size

    def sizes(self, problems, step):
        return [self.n] * len(problems)


def build_group_sizer(cfg) -> GroupSizer:
    factory = registry.resolve("group_size", cfg.control.group_size, "control.group_size")
    return registry.conform(factory(cfg), GroupSizer, "control.group_size")


def success_rate(group: Group) -> float:
    """Share of the group's samples that solved the prompt (reward >= 1, as Control counts)."""
    return sum(r >= 1.0 for r in group.rewards) / max(len(group.samples), 1)
