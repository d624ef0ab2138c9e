"""DUET (Hu et al. 2026, "DUET: Optimize Token-Budget Allocation for RLVR", arXiv 2605.08441;
docs/methods.md#duet) as an in-flight controller: control.inflight=duet.

Two decisions share one budget of rollouts per step, control.duet.budget times what the group
sizer asked for (prompts_per_step x group_size by default):

- How many rollouts each prompt gets (`allocate`, before generation): a prompt's
  informativeness is p(1-p) under its Beta(1 + successes, 1 + failures) posterior from earlier
  steps (an unseen prompt: 1/4, the most). The most informative prompts get group_min each
  while the budget lasts; the rest goes one rollout at a time to the prompt with the largest
  score / (n + 1) (proportional allocation, capped at group_max). A prompt left with none is
  skipped.
- When each rollout stops (`on_event`): the answer marker is a match of control.duet.marker
  in the response so far, or, by default, the task's answer extractor finding an answer there
  (\\boxed{} for math, the answer tag; for the arith tiers any text after the filler). Once it
  appears the rollout may run after_marker more tokens, then it stops and is trained as
  it stands. With no marker after horizon + grace tokens it is aborted and leaves the
  batch, except with probability q = keep_prob: then it runs to its end and its loss
  weight is 1/q (Sample.weight), so the batch's estimate of the mean reward stays unbiased:
  E[sum_i w_i r_i / n] is the mean reward of the run without aborts (`ht_mean`).

The abort details come from a third-party summary of the paper; the allocation rule is
rollwise's own minimal reading of "a pre-rollout surrogate" (docs/methods.md#duet).
"""

from __future__ import annotations

import dataclasses
import random
import re

from rollwise.stages.control.inflight import CONTINUE, Decision, InflightController
from rollwise.types import Group

AFTER_MARKER = Decision("abort", "duet_after_marker")
NO_MARKER = Decision("abort", "duet_no_marker")


def informativeness(successes: int, trials: int) -> float:
    p = (1 + successes) / (2 + trials)
    return p * (1 - p)


def allocate_budget(scores: list[float], budget: int, lo: int, hi: int) -> list[int]:
    """Rollouts per prompt: lo each to the highest scores while the budget lasts, then one
    at a time to the largest score / (n + 1), at most hi each (ties: the earlier prompt)."""
    n = [0] * len(scores)
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        if budget >= lo:
            n[i], budget = lo, budget - lo
    while budget > 0:
        open_ = [i for i in range(len(n)) if 0 < n[i] < hi]
        if not open_:
            break
        i = max(open_, key=lambda i: (scores[i] / (n[i] + 1), -i))
        n[i], budget = n[i] + 1, budget - 1
    return n


def ht_mean(rewards: list[float], weights: list[float], started: int) -> float:
    """Horvitz-Thompson estimate of the mean reward of `started` rollouts from the kept ones
    (aborted ones are absent, weight 0)."""
    return sum(w * r for w, r in zip(weights, rewards)) / max(started, 1)


def first_prefix(ids: list[int], found, seen: int = 0) -> int | None:
    """The fewest leading tokens of `ids` for which found(prefix) holds (a monotone test:
    once true, true for every longer prefix), given it fails within the first `seen`; None if
    it fails on the whole. Found in the whole, then placed to the token by bisection."""
    if not found(ids):
        return None
    lo, hi = seen, len(ids)  # not found in ids[:lo], found in ids[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if found(ids[:mid]) else (mid, hi)
    return hi


class Duet(InflightController):
    def __init__(self, cfg=None):
        c = cfg.control.duet
        self.share, self.lo, self.hi = c.budget, c.group_min, c.group_max
        self.horizon, self.grace, self.q = c.horizon, c.grace, c.keep_prob
        self.after = c.after_marker
        self.marker = re.compile(c.marker) if c.marker else None
        self.seed = cfg.run.seed
        self.stats: dict[str, list[int]] = {}  # prompt id -> [successes, trials]
        self.tokenizer = self.task = None
        self._dropped: set[str] = set()  # uids aborted without a marker
        self._started = 0
        self._metrics: dict[str, float] = {}

    def bind(self, tokenizer=None, task=None, **_) -> None:
        self.tokenizer, self.task = tokenizer, task

    # ---- before generation ----------------------------------------------------------------
    def allocate(self, problems, sizes: list[int]) -> list[int]:
        scores = [informativeness(*self.stats.get(p.id, (0, 0))) for p in problems]
        return allocate_budget(scores, round(self.share * sum(sizes)), self.lo, self.hi)

    def begin(self, want: int, step: int):
        self._dropped, self._started = set(), 0
        return [], want

    # ---- while generating -----------------------------------------------------------------
    def on_event(self, event, sample, rollout) -> Decision:
        if sample.finished or "duet" in sample.meta:
            return CONTINUE
        at = sample.meta.get("duet_marker_at")
        if at is None:
            at = self._marker_at(sample, sample.meta.get("duet_seen", 0))
            sample.meta["duet_seen"] = sample.num_tokens
            if at is not None:
                sample.meta["duet_marker_at"] = at
        limit = self.horizon + self.grace
        if at is not None and at <= limit:  # events come every engine.segment tokens: the
            stop = at + self.after  # limits hold at their token, by cutting what ran past
            return CONTINUE if sample.num_tokens < stop else \
                dataclasses.replace(AFTER_MARKER, keep=stop)
        if sample.num_tokens < limit:
            return CONTINUE
        if random.Random(f"{self.seed}:{sample.uid}").random() < self.q:
            sample.meta["duet"], sample.weight = "kept_tail", 1.0 / self.q
            return CONTINUE
        sample.meta["duet"] = "aborted"
        self._dropped.add(sample.uid)
        return NO_MARKER

    def _marker_at(self, sample, seen: int) -> int | None:
        """The response length at which the marker first appears (None: not yet), given none
        within the first `seen` tokens."""
        return first_prefix(sample.response_ids, self._has_marker, seen)

    def _has_marker(self, ids: list[int]) -> bool:
        if self.tokenizer is None or (self.task is None and self.marker is None):
            raise RuntimeError("control.inflight = duet finds answer markers in the decoded "
                               "response: bind the tokenizer and task (Control.bind)")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if self.marker is not None:
            return self.marker.search(text) is not None
        return self.task.extract_answer(text) is not None

    def end(self, rollout, want: int) -> list[Group]:
        dropped = 0
        for g in rollout.groups:
            self._started += len(g.samples)
            gone = [s for s in g.samples if s.uid in self._dropped]
            dropped += sum(s.num_tokens for s in gone)
            g.samples = [s for s in g.samples if s.uid not in self._dropped]
        rollout.ledger.tokens_to("aborted/duet_no_marker", dropped)
        return [g for g in rollout.groups if g.samples]

    # ---- after scoring --------------------------------------------------------------------
    def observe(self, scored: list[Group], step: int) -> None:
        samples = [s for g in scored for s in g.samples]
        self._metrics = {"duet/reward_mean_ht": ht_mean([s.reward for s in samples],
                                                         [s.weight for s in samples],
                                                         self._started),
                         "duet/kept_tails": sum(s.meta.get("duet") == "kept_tail"
                                                for s in samples)}
        for g in scored:
            st = self.stats.setdefault(g.prompt_id, [0, 0])
            st[0] += sum(r >= 1.0 for r in g.rewards)
            st[1] += len(g.samples)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict:
        return {"stats": {k: list(v) for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {k: list(v) for k, v in state["stats"].items()}
