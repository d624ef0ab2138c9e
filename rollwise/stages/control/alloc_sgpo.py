"""sGPO (Sudalairaj et al. 2026, "sGPO: Trading Inference FLOPs for Training Efficiency in
RLVR", arXiv 2606.08854; docs/methods.md#sgpo) as a GroupSizer: control.group_size = sgpo.

One profiling pass under the initial policy: control.sgpo.profile_samples samples of each prompt
give its success rate p. Prompts with p = 1 leave the pool (no signal left), a share
control.sgpo.unsolvable_keep of those with p = 0 stays, and each prompt is then sampled with
G = ceil(1/p) clipped to [group_min, group_max] (p = 0: group_max), the smallest group that
expects one success. The profiling tokens are generated and counted (tokens/profile/...) in
the first step, so a compute comparison includes them. p stays as profiled (one offline pass,
as in the paper); the paper's easy-to-hard ordering is left to the selector.
"""

from __future__ import annotations

import math
import random

from rollwise.stages.control.group_size import GroupSizer


class SGPO(GroupSizer):
    def __init__(self, cfg):
        c = cfg.control.sgpo
        self.k, self.lo, self.hi = c.profile_samples, c.group_min, c.group_max
        self.limit, self.keep_unsolvable = c.profile_prompts, c.unsolvable_keep
        self.seed = cfg.run.seed
        self.p: dict[str, float] | None = None  # prompt id -> profiled success rate
        self.ids: set[str] = set()  # the pool after filtering

    def group_size(self, p: float) -> int:
        if p <= 0:
            return self.hi
        return min(self.hi, max(self.lo, math.ceil(1 / p - 1e-9)))

    def pool(self, pool, profile):
        if self.p is None:
            self._profile(pool, profile)
        return [q for q in pool if q.id in self.ids]

    def _profile(self, pool, profile) -> None:
        rng = random.Random(f"sgpo:{self.seed}")  # its own stream: the run's stays as is
        todo = pool if self.limit is None or self.limit >= len(pool) \
            else rng.sample(pool, self.limit)
        outcomes = profile(todo, self.k)
        self.p = {pid: s / t for pid, (s, t) in outcomes.items()}
        unsolved = [q.id for q in todo if self.p[q.id] == 0]
        kept = rng.sample(unsolved, round(self.keep_unsolvable * len(unsolved)))
        self.ids = {q.id for q in todo if 0 < self.p[q.id] < 1} | set(kept)
        if not self.ids:
            raise RuntimeError(
                f"control.group_size = sgpo: the profiling pass over {len(todo)} prompts left "
                f"none to train on (every prompt solved every time, or none solved and "
                f"control.sgpo.unsolvable_keep = {self.keep_unsolvable}); raise "
                f"control.sgpo.unsolvable_keep or use a harder task")

    def sizes(self, problems, step):
        # a prompt the pass did not see (a curriculum's later pool): the default clip's top
        return [self.group_size(self.p.get(q.id, 0.0)) for q in problems]

    def extra(self, groups):
        return [0] * len(groups)

    def state_dict(self) -> dict:
        return {"p": self.p, "ids": sorted(self.ids)}

    def load_state_dict(self, state: dict) -> None:
        self.p, self.ids = state["p"], set(state["ids"])
