"""APRIL partial rollouts (docs/methods.md#april; RLsys-Foundation/APRIL
slime/rollout/sglang_example.py)
as an in-flight controller, so it works over any generator.

Keep `over_provision x want` groups in flight; as soon as `want` groups are complete, pause
every unfinished request and carry its group to the next round, where it resumes first (prompt
plus partial response re-prefilled under the new weights, with max_new_tokens reduced by what
it already generated). So one long response no longer holds the whole step.

Unlike the released APRIL code, a carried sample keeps its token ids (never re-tokenized text),
the behaviour log-probability and the policy version of every token, so the trainer's
importance correction sees exactly which tokens are stale. The carry is plain data: it is
saved with checkpoints (state_dict) and nothing in flight is lost.
"""

from __future__ import annotations

import math

from rollwise.stages.control.inflight import CONTINUE, Decision, InflightController
from rollwise.types import Group

BATCH_COMPLETE = Decision("pause", "batch_complete", everyone=True)


class April(InflightController):
    def __init__(self, cfg=None, over_provision: float | None = None):
        """cfg: the run's Config (control.april.over_provision: groups in flight per group
        wanted)."""
        if over_provision is None:
            over_provision = cfg.control.april.over_provision
        self.over = over_provision
        if self.over < 1:
            raise ValueError(f"control.april.over_provision = {self.over}: must be >= 1")
        self.carry: list[Group] = []  # groups with paused members, oldest first
        self.want, self.step = 0, 0

    def begin(self, want: int, step: int) -> tuple[list[Group], int]:
        carried, self.carry = self.carry, []
        self.want, self.step = want, step
        done = [all(s.finished for s in g.samples) for g in carried]
        if sum(done) >= want:  # the batch is there already: resume nothing this round
            self.carry = [g for g, d in zip(carried, done) if not d]
            return [g for g, d in zip(carried, done) if d], 0
        return carried, max(0, math.ceil(self.over * want) - len(carried))

    def on_event(self, event, sample, rollout) -> Decision:
        return BATCH_COMPLETE if len(rollout.completed) >= self.want else CONTINUE

    def end(self, rollout, want: int) -> list[Group]:
        """Exactly `want` complete groups (or every complete one, if fewer finished); the
        rest, paused or complete beyond the batch, wait for the next round."""
        done = rollout.completed
        complete = {id(g) for g in done}
        self.carry += [g for g in rollout.groups if id(g) not in complete]
        for g in done[want:]:  # finished beyond the batch: first in line next round
            self.carry.insert(0, g)
        # every token held over, paused or in a complete group beyond the batch
        rollout.ledger.tokens_to("paused_carried", sum(s.num_tokens for g in self.carry
                                                       for s in g.samples))
        for g in done[:want]:
            for s in g.samples:
                s.step = self.step
        return done[:want]

    def state_dict(self) -> dict:
        return {"carry": [g.to_dict() for g in self.carry]}

    def load_state_dict(self, state: dict) -> None:
        self.carry = [Group.from_dict(g) for g in state["carry"]]
