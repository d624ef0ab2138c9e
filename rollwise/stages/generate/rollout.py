"""The rollout driver: one round of generation, shared by every generator.

A generator adds groups (their samples fresh or partial) and runs the rollout; the driver feeds
each engine event's tokens into its sample (Sample.extend: token ids, behaviour log-probs,
versions, entropies, never re-tokenized text) and asks the generator's own hook (a tree's
branching) and then the in-flight controller what to do, applying pause / abort / fork and
counting each decision with its reason. A sample's request is always prompt + its response so
far, so a paused sample resumes where it stopped, under the weights of the moment.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rollwise.engine import Completion, Event, Request, SamplingParams
from rollwise.stages.control.inflight import CONTINUE, Decision, InflightController
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Sample, Status

FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED,
          "paused": Status.PAUSED}

EventHook = Callable[[Event, Sample, "Rollout"], Decision | None]


class Rollout:
    def __init__(self, engine, controller: InflightController, ledger: Ledger,
                 params: SamplingParams):
        if engine.has_unfinished():
            raise RuntimeError("a rollout round needs an idle engine, but requests from an "
                               "earlier round are still in flight")
        self.engine, self.controller, self.ledger, self.params = engine, controller, ledger, params
        self.groups: list[Group] = []  # every group of the round, in the order added
        self.completed: list[Group] = []  # groups whose every sample finished, in that order
        self._owner: dict[int, tuple[Group, Sample, int]] = {}  # seq -> group, sample, base
        self._pending: dict[int, int] = {}  # id(group) -> its unfinished samples
        self._stop: Decision | None = None  # an `everyone` decision ends the round

    # ---- what generators call ------------------------------------------------------------------
    def add(self, group: Group) -> None:
        """Queue every unfinished sample of the group (from where it stands)."""
        self.groups.append(group)
        todo = [s for s in group.samples if not s.finished]
        self._pending[id(group)] = len(todo)
        if not todo:
            self.completed.append(group)
        for s in todo:
            self._submit(group, s)

    def run(self, on_event: EventHook | None = None) -> None:
        """Step the engine until every request ended or a decision ended the round; then the
        round's unfinished requests are paused (or aborted) as that decision says. Running it
        again continues what was added since (nothing, once a decision ended the round)."""
        while self._stop is None and self.engine.has_unfinished():
            for ev in self.engine.step():
                self._event(ev, on_event)
        if self._stop is not None and self._owner:
            live = list(self._owner)
            for seq_id in live:
                self._apply(seq_id, dataclasses.replace(self._stop, everyone=False), count=False)
            self.ledger.decide("control", self._stop.action, self._stop.reason, len(live))

    def decide_for(self, sample: Sample, decision: Decision) -> None:
        """Apply a decision to another live sample of the round (a controller that decides for
        a whole group at once: ARRoL's pruning); a sample no longer live is left alone."""
        seq_id = next((k for k, (_, s, _) in self._owner.items() if s is sample), None)
        if seq_id is not None and decision.action != "continue":
            self._apply(seq_id, decision)

    # ---- the driver --------------------------------------------------------------------------
    def _submit(self, group: Group, s: Sample) -> None:
        params = self.params
        if s.num_tokens:  # resumed: only what is left of the budget
            s.meta["resumed"] = s.meta.get("resumed", 0) + 1
            params = dataclasses.replace(params,
                                         max_new_tokens=params.max_new_tokens - s.num_tokens)
        s.status = Status.RUNNING
        seq_id = self.engine.add(Request(s.prompt_ids + s.response_ids, params, s.uid))
        self._owner[seq_id] = (group, s, s.num_tokens)

    def _event(self, ev: Event, on_event: EventHook | None) -> None:
        if ev.seq_id not in self._owner:
            return  # paused or aborted by an earlier decision of this engine step
        group, s, _ = self._owner[ev.seq_id]
        s.extend(ev.token_ids, ev.logprobs, ev.versions, ev.entropies)
        if ev.finished:
            s.status = FINISH[ev.finish_reason]
            self._finished(ev.seq_id)
        decision = (on_event(ev, s, self) if on_event else None) or CONTINUE
        if decision.action == "continue":
            decision = self.controller.on_event(ev, s, self)
        if decision.everyone:
            self._stop = self._stop or decision
        elif decision.action != "continue" and not ev.finished:
            self._apply(ev.seq_id, decision)

    def _apply(self, seq_id: int, d: Decision, count: bool = True) -> None:
        group, s, base = self._owner[seq_id]
        if count:
            self.ledger.decide("control", d.action, d.reason)
        if d.action == "fork":
            for child_id in self.engine.fork(seq_id, d.n):
                child = s.fork()
                group.samples.append(child)
                self._pending[id(group)] += 1
                self._owner[child_id] = (group, child, base)
            return
        c: Completion = self.engine.pause(seq_id) if d.action == "pause" \
            else self.engine.abort(seq_id)
        k = s.num_tokens - base  # events carried the tokens up to here
        s.extend(c.token_ids[k:], c.logprobs[k:], c.versions[k:], c.entropies[k:])
        s.status = FINISH[c.finish_reason]
        if d.action == "abort":
            self._finished(seq_id)
        else:
            del self._owner[seq_id]

    def _finished(self, seq_id: int) -> None:
        group, _, _ = self._owner.pop(seq_id)
        self._pending[id(group)] -= 1
        if self._pending[id(group)] == 0:
            self.completed.append(group)
