"""The rollout driver: one round of generation, shared by every generator.

A generator adds groups (their samples fresh or partial) and runs the rollout; the driver feeds
each engine event's tokens into its sample (Sample.extend: token ids, behaviour log-probs,
versions, entropies, never re-tokenized text) and asks the generator's own hook (a tree's
branching) and then the in-flight controller what to do, applying pause / abort / fork and
counting each decision with its reason. A sample's request is always prompt + its response so
far, so a paused sample resumes where it stopped, under the weights of the moment.

With keep_kv (loop.carried_kv=keep, on an engine that can_keep_paused) a paused sample's
sequence stays in the engine with its K/V: a later round that adds the sample resumes that
sequence (no prefill, its own random stream) instead of submitting it again. Otherwise the
engine's paused sequence is dropped once its tokens are in the sample, and a later round
prefills prompt + response again under the weights of that moment.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Callable

from rollwise import registry
from rollwise.engine import Completion, Engine, Event, Request, SamplingParams
from rollwise.stages.control.inflight import CONTINUE, Decision, InflightController
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Sample, Status

FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED,
          "paused": Status.PAUSED}

EventHook = Callable[[Event, Sample, "Rollout"], Decision | None]


class Rollout:
    def __init__(self, engine, controller: InflightController, ledger: Ledger,
                 params: SamplingParams, gate=None, keep_kv: bool = False):
        """gate: the asynchronous loop's WeightGate (rollwise.loop.async_), held for each
        engine step and its events so that no weight push lands between them; None when
        nothing pushes weights during the round. keep_kv: paused samples keep their K/V in
        the engine for a later round (the engine must can_keep_paused)."""
        engine = registry.conform(engine, Engine, "the rollout's engine")
        if keep_kv and not getattr(engine, "can_keep_paused", False):
            raise ValueError(f"keep_kv: {type(engine).__name__} cannot keep a paused "
                             f"sequence's K/V; use the built-in engine or recompute")
        self.keep_kv = keep_kv
        if engine.has_unfinished():
            raise RuntimeError("a rollout round needs an idle engine, but requests from an "
                               "earlier round are still in flight")
        # a round reuses only its own K/V: its numbers never depend on what an earlier round
        engine.reset_prefix_cache()  # (an evaluation, say) left in the cache
        self.engine, self.controller, self.ledger, self.params = engine, controller, ledger, params
        self.gate = gate
        self.groups: list[Group] = []  # every group of the round, in the order added
        self.completed: list[Group] = []  # groups whose every sample finished, in that order
        self._owner: dict[int, tuple[Group, Sample, int]] = {}  # seq -> group, sample, base
        self._pending: dict[int, int] = {}  # id(group) -> its unfinished samples
        self._stop: Decision | None = None  # an `everyone` decision ends the round

    # ---- what generators call ------------------------------------------------------------------
    def add(self, group: Group, params: SamplingParams | None = None) -> None:
        """Queue every unfinished sample of the group (from where it stands), with `params`
        (default: the round's)."""
        self.groups.append(group)
        todo = [s for s in group.samples if not s.finished]
        self._pending[id(group)] = len(todo)
        if not todo:
            self.completed.append(group)
        for s in todo:
            self._submit(group, s, params)

    def extend(self, group: Group, samples: list[Sample],
               params: SamplingParams | None = None) -> None:
        """Add new samples to a group of this round and queue them (a tree filling its group
        with i.i.d. samples). A group already complete is reopened."""
        if not samples:
            return
        group.samples += samples
        if self._pending[id(group)] == 0:
            self.completed.remove(group)
        self._pending[id(group)] += len(samples)
        for s in samples:
            self._submit(group, s, params)

    def requeue(self, group: Group, samples: list[Sample],
                 params: SamplingParams | None = None) -> None:
        """Queue finished samples of a group of this round again, from where they stand (an
        agent episode's next turn, after the environment's tokens were appended)."""
        if not samples:
            return
        if self._pending[id(group)] == 0:
            self.completed.remove(group)
        self._pending[id(group)] += len(samples)
        for s in samples:
            self._submit(group, s, params)

    def fork(self, sample: Sample, n: int, reason: str,
             tokens: list[int] | None = None) -> list[Sample]:
        """n children of a live sample, sharing its prefix, added to its group; with `tokens`,
        each child's latest token is replaced by its own (chosen, not sampled). Returns the
        children (a tree registers them). Call it from the sample's event hook."""
        seq_id = self._seq_of(sample)
        if seq_id is None:
            raise ValueError(f"sample {sample.uid} is not live in this round")
        d = Decision("fork", reason, n=n, tokens=None if tokens is None else tuple(tokens))
        self.ledger.decide("generate", "fork", reason)
        return self._fork(seq_id, d)

    def discard(self, sample: Sample, reason: str) -> None:
        """Take a sample of this round out of its group (a pruned tree branch), stopping it
        first if it is still generating: its tokens are counted as pruned/<reason>, never
        trained."""
        seq_id = self._seq_of(sample)
        if seq_id is not None:
            group = self._owner[seq_id][0]
            self._apply(seq_id, Decision("abort", reason), count=False)
        else:
            group = next((g for g in self.groups if any(x is sample for x in g.samples)), None)
            if group is None:
                raise ValueError(f"sample {sample.uid} is not in a group of this round")
        group.samples.remove(sample)
        self.ledger.decide("generate", "prune", reason)
        self.ledger.tokens_to(f"pruned/{reason}", sample.num_tokens)

    def switch_params(self, sample: Sample, params: SamplingParams) -> None:
        """Continue a live sample under other sampling settings (LATR's stochastic tail after
        its greedy tree phase), with no re-prefill: the engine forks it once with `params` and
        drops the original. Call it from the sample's event hook (no token unreported)."""
        seq_id = self._seq_of(sample)
        if seq_id is None:
            raise ValueError(f"sample {sample.uid} is not live in this round")
        child, = self.engine.fork(seq_id, 1, params=params)
        self._owner[child] = self._owner.pop(seq_id)
        self.engine.abort(seq_id)

    def run(self, on_event: EventHook | None = None) -> None:
        """Step the engine until every request ended or a decision ended the round; then the
        round's unfinished requests are paused (or aborted) as that decision says. Running it
        again continues what was added since (nothing, once a decision ended the round)."""
        while self._stop is None and self.engine.has_unfinished():
            with self.gate.shared() if self.gate is not None else nullcontext():
                for ev in self.engine.step():  # no weight push between a step and its events
                    self._event(ev, on_event)
        if self._stop is not None and self._owner:
            live = list(self._owner)
            for seq_id in live:
                self._apply(seq_id, dataclasses.replace(self._stop, everyone=False), count=False)
            self.ledger.decide("control", self._stop.action, self._stop.reason, len(live))

    def decide_for(self, sample: Sample, decision: Decision) -> None:
        """Apply a decision to another live sample of the round (a controller that decides for
        a whole group at once: ARRoL's pruning); a sample no longer live is left alone."""
        seq_id = self._seq_of(sample)
        if seq_id is not None and decision.action != "continue":
            self._apply(seq_id, decision)

    # ---- the driver --------------------------------------------------------------------------
    def _submit(self, group: Group, s: Sample, params: SamplingParams | None = None) -> None:
        params = params or self.params
        # an agent episode's budget is per turn (rollwise.agents.episode): its tokens count from
        # the turn's start, against the turn's own budget
        start = s.meta.get("turn_start", 0)
        budget = s.meta.get("turn_budget", params.max_new_tokens)
        if s.num_tokens > start:  # resumed: only what is left of the budget
            s.meta["resumed"] = s.meta.get("resumed", 0) + 1
        if s.num_tokens > start or budget != params.max_new_tokens:
            params = dataclasses.replace(params,
                                         max_new_tokens=budget - (s.num_tokens - start))
        if "seed" in s.meta:  # a sample's own stream (sampled evaluation): each request of it
            # draws from the sample's seed and its length, whatever else the engine runs
            params = dataclasses.replace(params, seed=s.meta["seed"] + s.num_tokens)
        s.status = Status.RUNNING
        kept = self.engine.find_paused(s.uid, s.prompt_ids + s.response_ids) \
            if self.keep_kv else None
        if kept is not None:  # its sequence is in the engine: continue it where it stopped
            seq_id, n = kept
            self.engine.resume(seq_id)
            self._owner[seq_id] = (group, s, s.num_tokens - n)
            return
        seq_id = self.engine.add(Request(s.prompt_ids + s.response_ids, params, s.uid))
        self._owner[seq_id] = (group, s, s.num_tokens)

    def _event(self, ev: Event, on_event: EventHook | None) -> None:
        if ev.seq_id not in self._owner:
            return  # paused or aborted by an earlier decision of this engine step
        group, s, _ = self._owner[ev.seq_id]
        if ev.cached_tokens:  # its prompt's K/V came from the engine's prefix cache
            s.meta["kv_cached"] = s.meta.get("kv_cached", 0) + ev.cached_tokens
            self.ledger.decide("engine", "prefix_cache", "tokens", ev.cached_tokens)
        s.extend(ev.token_ids, ev.logprobs, ev.versions, ev.entropies)
        if ev.finished:
            s.status = FINISH[ev.finish_reason]
            self._finished(ev.seq_id)
        decision = (on_event(ev, s, self) if on_event else None) or CONTINUE
        seq_id = ev.seq_id if ev.seq_id in self._owner or ev.finished else self._seq_of(s)
        if seq_id is None:
            return  # the hook discarded it
        if decision.action == "continue":
            decision = self.controller.on_event(ev, s, self)
        if decision.everyone:
            self._stop = self._stop or decision
        elif decision.action != "continue" and not ev.finished:
            self._apply(seq_id, decision)

    def _seq_of(self, sample: Sample) -> int | None:
        return next((k for k, (_, s, _) in self._owner.items() if s is sample), None)

    def _apply(self, seq_id: int, d: Decision, count: bool = True) -> None:
        group, s, base = self._owner[seq_id]
        if count:
            self.ledger.decide("control", d.action, d.reason)
        if d.action == "fork":
            self._fork(seq_id, d)
            return
        keep = d.action == "pause" and self.keep_kv
        c: Completion = self.engine.pause(seq_id, keep=True) if keep else \
            self.engine.pause(seq_id) if d.action == "pause" else self.engine.abort(seq_id)
        if d.action == "pause" and not keep:  # resubmitted as a new request later: the
            self.engine.abort(seq_id)  # engine need not hold its tokens meanwhile
        k = s.num_tokens - base  # events carried the tokens up to here
        s.extend(c.token_ids[k:], c.logprobs[k:], c.versions[k:], c.entropies[k:])
        s.status = FINISH[c.finish_reason]
        if d.keep is not None and d.keep < s.num_tokens:  # the limit, to the token: what the
            self.ledger.decide("control", "cut_tokens", d.reason, s.num_tokens - d.keep)
            s.cut(d.keep)  # engine ran past it is decoded, never trained
        if d.action == "abort":
            self._finished(seq_id)
        else:
            del self._owner[seq_id]

    def _fork(self, seq_id: int, d: Decision) -> list[Sample]:
        group, s, base = self._owner[seq_id]
        tokens = list(d.tokens) if d.tokens is not None else None
        children = []
        for child_id in self.engine.fork(seq_id, d.n, last_tokens=tokens):
            child = s.fork()
            if tokens is not None:  # the engine's next event brings the chosen token
                child_forgets_last_token(child)
                child.chosen.append(child.num_tokens)
            group.samples.append(child)
            self._pending[id(group)] += 1
            self._owner[child_id] = (group, child, base)
            children.append(child)
        return children

    def _finished(self, seq_id: int) -> None:
        group, _, _ = self._owner.pop(seq_id)
        self._pending[id(group)] -= 1
        if self._pending[id(group)] == 0:
            self.completed.append(group)


def child_forgets_last_token(child: Sample) -> None:
    """A child branching on another token: drop the inherited latest token (the engine reports
    the replacement, with its log-probability, in the child's next event)."""
    n = child.num_tokens - 1
    for name in ("response_ids", "logprobs", "versions", "loss_mask", "entropies"):
        col = getattr(child, name)
        if len(col) > n:
            del col[n:]
    child.chosen = [i for i in child.chosen if i < n]
    child.branch_point = n
