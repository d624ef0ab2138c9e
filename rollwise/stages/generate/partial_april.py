"""APRIL partial rollouts (METHODS.md §2.2; RLsys-Foundation/APRIL slime/rollout/sglang_example.py).

Keep `over_provision x want` groups in flight; as soon as `want` groups are complete, pause
every unfinished request and carry its group to the next step, where it resumes first (prompt
plus partial response re-prefilled under the new weights, with max_new_tokens reduced by what
it already generated). So one long response no longer holds the whole step.

Unlike the released APRIL code, a carried sample keeps its token ids (never re-tokenized text),
the behaviour log-probability and the policy version of every token, so the trainer's
importance correction sees exactly which tokens are stale. The carry is plain data: it is
saved with checkpoints (state_dict) and nothing in flight is lost.
"""

from __future__ import annotations

import dataclasses
import math

from rollwise.engine import Request
from rollwise.stages.generate.group import new_sample, sampling_params
from rollwise.stages.ledger import Ledger
from rollwise.tasks import Problem
from rollwise.types import Group, Sample, Status


class PartialRolloutGenerator:
    def __init__(self, cfg, tokenizer, over_provision: float = 2.0):
        """cfg: GenerateConfig. over_provision: groups in flight per group wanted (>= 1)."""
        if over_provision < 1:
            raise ValueError(f"control.over_provision = {over_provision}: must be >= 1")
        self.cfg, self.tokenizer, self.over = cfg, tokenizer, over_provision
        self.params = sampling_params(cfg, tokenizer.eos_token_id)
        self.carry: list[Group] = []  # groups with paused members, oldest first

    def generate(self, engine, select, want: int, step: int, ledger: Ledger) -> list[Group]:
        """Exactly `want` complete groups (or every group in flight, if fewer finish).

        select(n) -> list[Problem] picks new prompts; carried groups go first."""
        if engine.has_unfinished():
            raise RuntimeError("APRIL needs an idle engine at the start of a step")
        inflight, self.carry = self.carry, []
        n_new = max(0, math.ceil(self.over * want) - len(inflight))
        inflight += [Group(p.id, [new_sample(p, self._prompt(p), step)
                                  for _ in range(self.cfg.group_size)], p)
                     for p in (select(n_new) if n_new else [])]
        owner: dict[int, tuple[Group, Sample]] = {}
        for g in inflight:
            for s in g.samples:
                if not s.finished:
                    owner[self._submit(engine, s)] = (g, s)
        done: list[Group] = [g for g in inflight if all(s.finished for s in g.samples)]
        pending = {id(g): sum(not s.finished for s in g.samples) for g in inflight}
        while len(done) < want and engine.has_unfinished():
            for ev in engine.step():
                g, s = owner[ev.seq_id]
                _append(s, ev.token_ids, ev.logprobs, ev.versions, ev.entropies)
                if ev.finished:
                    s.status = _STATUS[ev.finish_reason]
                    pending[id(g)] -= 1
                    if pending[id(g)] == 0:
                        done.append(g)
        for seq_id, (g, s) in owner.items():  # stop the step: pause everything unfinished
            if not s.finished:
                c = engine.pause(seq_id)  # all of this request's tokens; events had a prefix
                k = len(s.response_ids) - s.meta["resume_at"]
                _append(s, c.token_ids[k:], c.logprobs[k:], c.versions[k:], c.entropies[k:])
                s.status = Status.PAUSED
        complete = {id(g) for g in done}
        self.carry = [g for g in inflight if id(g) not in complete]
        ledger.decide("control", "pause", "batch_complete",
                      sum(not s.finished for g in self.carry for s in g.samples))
        for g in done[want:]:  # finished beyond the batch: keep them for the next step
            self.carry.insert(0, g)
        # every token held over, paused or in a complete group beyond the batch
        ledger.tokens_to("paused_carried", sum(s.num_tokens for g in self.carry
                                               for s in g.samples))
        for g in done[:want]:
            for s in g.samples:
                s.step = step
        return done[:want]

    def _prompt(self, p: Problem) -> list[int]:
        return self.tokenizer(p.prompt)["input_ids"]

    def _submit(self, engine, s: Sample) -> int:
        """Queue a sample from where it stands: prompt + its partial response."""
        left = self.params.max_new_tokens - s.num_tokens
        s.meta["resume_at"] = s.num_tokens
        if s.num_tokens:
            s.meta["resumed"] = s.meta.get("resumed", 0) + 1
        s.status = Status.RUNNING
        params = dataclasses.replace(self.params, max_new_tokens=left)
        return engine.add(Request(s.prompt_ids + s.response_ids, params, s.uid))

    def state_dict(self) -> dict:
        return {"carry": [[dataclasses.asdict(s) for s in g.samples] for g in self.carry],
                "problems": [dataclasses.asdict(g.problem) for g in self.carry]}

    def load_state_dict(self, state: dict) -> None:
        self.carry = []
        for samples, problem in zip(state["carry"], state["problems"]):
            p = Problem(**problem)
            rows = [Sample(**{**d, "status": Status(d["status"])}) for d in samples]
            self.carry.append(Group(p.id, rows, p))


_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def _append(s: Sample, tokens, logprobs, versions, entropies) -> None:
    s.response_ids += tokens
    s.logprobs += logprobs
    s.versions += versions
    s.entropies += entropies
    s.loss_mask += [1] * len(tokens)
