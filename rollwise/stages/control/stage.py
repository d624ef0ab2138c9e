"""The Control stage: where compute goes. Which prompts (a Selector over the pool, which a
curriculum hook may narrow), how many generation rounds a step takes (Refill: DAPO dynamic
sampling), and what happens to requests in flight (an InflightController: APRIL, ...).

    control = Control(cfg, task)
    for n in control.rounds(want, kept):          # one round, or refills until `want` are kept
        problems = control.select(k, step, ledger)
        problems = control.sized(problems, step, ledger)  # samples per prompt: Problem.group_size
        ... score; extra = control.extra(groups)  # more samples for some groups (DARS)
    kept = control.trim(kept, want, ledger)
    control.observe(scored, step)                 # selectors and curricula learn from outcomes
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

from rollwise.stages.control.base import build_selector
from rollwise.stages.control.baseline import Baseline
from rollwise.stages.control.group_size import Profile, build_group_sizer
from rollwise.stages.control.inflight import build_inflight
from rollwise.stages.control.seed_icl import IclSeeder
from rollwise.stages.ledger import Ledger
from rollwise.stages.replay.curriculum import build_curriculum
from rollwise.types import Group, Problem


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



def prompt_outcomes(scored: list[Group]) -> dict[str, tuple[int, int]]:
    """(successes, trials) per prompt of a step's scored groups: what selectors learn from."""
    return {g.prompt_id: (sum(r >= 1.0 for r in g.rewards), len(g.samples)) for g in scored}

class Control:
    def __init__(self, cfg, task, rng: random.Random):
        self.cfg, self.task, self.rng = cfg, task, rng
        self.selector = build_selector(cfg)
        self.curriculum = build_curriculum(cfg.replay)
        self.inflight = build_inflight(cfg)
        self.refill = Refill(cfg)
        self.sizer = build_group_sizer(cfg)
        self.seeder = IclSeeder(cfg) if cfg.control.icl_seeding.exemplars > 0 else None
        self.baseline = Baseline(cfg) if cfg.control.baseline != "none" else None
        self.profile: Profile | None = None  # set by the loop: (problems, k, ledger) -> outcomes

    def bind(self, **context) -> None:
        """What a part may need beyond the config (profile, policy, tokenizer, task): the
        loop passes it here; the in-flight controller takes its share through its own bind."""
        self.profile = context.get("profile", self.profile)
        self.inflight.bind(**context)
        self.sizer.bind(**context)
        if self.seeder is not None:
            self.seeder.bind(**context)

    def rounds(self, want: int, kept: list[Group]) -> Iterator[int]:
        return self.refill.rounds(want, kept)

    def trim(self, kept: list[Group], want: int, ledger: Ledger) -> list[Group]:
        return self.refill.trim(kept, want, ledger)

    def select(self, n: int, step: int, ledger: Ledger) -> list[Problem]:
        if n == 0:
            return []
        ledger.decide("control", "select", self.cfg.control.selector, n)
        return self.selector.select(self._pool(step, ledger), n, self.rng)

    def prepare(self, step: int, ledger: Ledger) -> None:
        """Before a step's generation: the sizer's pool is made now (sGPO's profiling pass
        runs the engine, so it must not start inside a round; its tokens go to `ledger`)."""
        self._pool(step, ledger)

    def _pool(self, step: int, ledger: Ledger) -> list[Problem]:
        """The prompts to select from: the task's, narrowed by a curriculum, then the sizer."""
        pool = self.task.train if self.curriculum is None \
            else self.curriculum.pool(self.task.train, step)
        return self.sizer.pool(pool, lambda problems, k: self._profile(problems, k, ledger))

    def metrics(self) -> dict[str, float]:
        """The selector's, the group sizer's and the in-flight controller's own numbers for
        this step (what VADE's draws picked, XRPO's group sizes, ARRoL's head AUC)."""
        extra = [p.metrics() for p in (self.seeder, self.baseline) if p is not None]
        return {**self.selector.metrics(), **self.sizer.metrics(), **self.inflight.metrics(),
                **{k: v for m in extra for k, v in m.items()}}

    def _profile(self, problems: list[Problem], k: int, ledger: Ledger
                 ) -> dict[str, tuple[int, int]]:
        if self.profile is None:
            raise RuntimeError(f"control.group_size = {self.cfg.control.group_size} profiles "
                               "prompts, but nothing bound a profiler (Control.bind(profile=))")
        return self.profile(problems, k, ledger)

    def sized(self, problems: list[Problem], step: int, ledger: Ledger) -> list[Problem]:
        """Each problem (its ids made) as a copy carrying its group size: the sizer's, then
        the in-flight controller's allocation (ARRoL over-samples, DUET spreads a budget).
        A prompt given 0 samples is skipped, and counted."""
        sizes = self.sizer.sizes(problems, step)
        sizes = self.inflight.allocate(problems, sizes)
        out = []
        for p, n in zip(problems, sizes):
            if n <= 0:
                ledger.decide("control", "skip", "no_samples_allocated")
            else:
                out.append(dataclasses.replace(p, group_size=int(n)))
        return out if self.seeder is None else self.seeder.transform(out)

    def extra(self, groups: list[Group]) -> list[int]:
        """Samples to add to each scored group before it is trained on (DARS)."""
        return self.sizer.extra(groups)

    def observe(self, scored: list[Group], step: int) -> None:
        """Every scored group, kept or not: (successes, trials) per prompt."""
        outcomes = prompt_outcomes(scored)
        self.selector.observe(outcomes, step)
        self.inflight.observe(scored, step)  # a learned controller (ARRoL's quality head)
        self.sizer.observe(scored, step)  # CurES's gradient norms, V0's history
        if self.baseline is not None:  # each sample's baseline from earlier steps (MSSR)
            self.baseline.annotate(scored, step)
        if self.seeder is not None:
            self.seeder.observe(scored, step)
        if self.curriculum is not None:
            self.curriculum.observe(outcomes, step)

    def parts(self) -> dict:
        """The stateful parts, for checkpoints."""
        return {"selector": self.selector, "inflight": self.inflight,
                "curriculum": self.curriculum, "group_size": self.sizer,
                "icl_seeding": self.seeder, "baseline": self.baseline}
