"""DARS (Yang et al. 2025, "Depth-Breadth Synergy in RLVR", yangzhch6/DARS
ray_dars_trainer.py; docs/methods.md#dars) as a GroupSizer: control.group_size = dars.

Stage 1 samples generate.group_size (N) rollouts per prompt. A group whose success rate p
(p = 0 counted as 0.5/n) is below 1/2 gets dn more at the same temperature, merged into it
before the advantages, so hard prompts weigh as much as medium ones in the update:

    S(p) = 2 p (1 - p)                 the mean |advantage| of a group at rate p
    equal treatment:     dn = ceil((0.5 n - n S) / S)
    hardness weighted:   dn = ceil((2 (1 - p) 0.5 n - n S) / S)

capped so the group holds at most control.dars.max (4N or 8N by default: 32 and 64 at N = 8,
as in the paper's scripts). With N = 8: p = 0, 1/8, 1/4, 3/8 give 24, 11, 3, 1 (et) and 56,
24, 8, 3 (hw).
"""

from __future__ import annotations

import math

from rollwise.stages.control.group_size import GroupSizer, success_rate


def dars_extra(n: int, p: float, schedule: str, n_max: int) -> int:
    """Extra rollouts for a group of n at success rate p."""
    p = p if p > 0 else 0.5 / n
    if p >= 0.5:
        return 0
    s = 2 * p * (1 - p)
    target = 0.5 * n if schedule == "et" else 2 * (1 - p) * 0.5 * n
    return max(0, min(math.ceil((target - n * s) / s - 1e-9), n_max - n))


class DARS(GroupSizer):
    def __init__(self, cfg):
        self.n, self.schedule = cfg.generate.group_size, cfg.control.dars.schedule
        self.n_max = cfg.control.dars.max or self.n * (4 if self.schedule == "et" else 8)

    def pool(self, pool, profile):
        return pool

    def sizes(self, problems, step):
        return [self.n] * len(problems)

    def extra(self, groups):
        return [dars_extra(len(g.samples), success_rate(g), self.schedule, self.n_max)
                for g in groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
