"""How many samples each prompt gets: a GroupSizer, chosen by `control.group_size`.

    fixed   every prompt gets generate.group_size (the GRPO default)
    sgpo    G = 1/p from a profiling pass (alloc_sgpo.py)
    dars    extra rollouts for hard prompts after the first ones are scored (alloc_dars.py)
    xrpo    a base share each, the rest by confidence-interval shrinkage (alloc_xrpo.py)
    cures   the step's budget in proportion to each prompt's gradient-variance term (alloc_cures.py)
    v0      the step's budget by a predicted success rate, before generation (value_v0.py)

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

    def bind(self, **context) -> None:
        """The run's context, once (policy=, prompter=, task=): what a sizer may read."""

    def observe(self, scored: list[Group], step: int) -> None:
        """After scoring, every scored group of the step: learn from the outcomes."""

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


def proportional_sizes(weights: list[float], budget: int, n_min: int, n_max: int) -> list[int]:
    """Integer group sizes in [n_min, n_max] summing to `budget` (as near as the bounds allow),
    in proportion to `weights` above the floor: every prompt gets n_min, the rest of the
    budget is split by weight (equal split when every weight is 0) with the largest
    remainders rounded up, capped at n_max with the excess passed on to the uncapped."""
    n = len(weights)
    if n == 0:
        return []
    if min(weights) < 0:
        raise ValueError(f"proportional_sizes needs weights >= 0, got {min(weights)}")
    sizes = [n_min] * n
    left = max(0, budget - n_min * n)
    open_ = [i for i in range(n) if sizes[i] < n_max]
    while left > 0 and open_:
        total = sum(weights[i] for i in open_)
        share = {i: left * (weights[i] / total if total > 0 else 1 / len(open_)) for i in open_}
        room = {i: n_max - sizes[i] for i in open_}
        capped = [i for i in open_ if share[i] >= room[i]]
        if capped:  # they take what fits; the rest is shared again among the others
            for i in capped:
                sizes[i] += room[i]
                left -= room[i]
            open_ = [i for i in open_ if i not in capped]
            continue
        floors = {i: int(share[i]) for i in open_}
        for i in open_:
            sizes[i] += floors[i]
        rest = left - sum(floors.values())
        by_remainder = sorted(open_, key=lambda i: (-(share[i] - floors[i]), i))
        for i in by_remainder[:rest]:
            sizes[i] += 1
        left = 0
    return sizes
