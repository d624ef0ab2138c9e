"""A minimal reference engine for the engine contract: the protocols of rollwise/engine/base.py
with nothing clever. One sequence at a time, a full forward pass over prompt + tokens for every
token (no KV cache, no batching), the same sampling math and per-request seeded streams as the
built-in engine. tests/engine/test_engine_contract.py runs the contract checks on it beside the
built-in engine, so the checks are known to hold for the plainest possible implementation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from rollwise.engine import Completion, Engine, Event, Request, SamplingParams
from rollwise.engine.builtin import SparseUpdate, _scatter
from rollwise.engine.sampling import SeedStream, sample


@dataclass
class Seq:
    seq_id: int
    request_id: object
    prompt: list[int]
    params: SamplingParams
    rng: SeedStream
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list = field(default_factory=list)
    emitted: int = 0
    finish: str | None = None

    def completion(self) -> Completion:
        return Completion(self.request_id, list(self.tokens), list(self.logprobs),
                          list(self.entropies), list(self.versions), self.finish or "length",
                          self.seq_id, top_logprobs=list(self.top) or None)


class ReferenceEngine(Engine):
    def __init__(self, model, *, seed: int = 0, segment: int = 16, version: int = 0):
        self.model, self.segment, self.version = model, segment, version
        self.tokens_generated = 0
        self._seeds, self._next = random.Random(seed), 0
        self._running: list[Seq] = []
        self._paused: dict[int, Seq] = {}

    # Engine
    def add(self, request: Request) -> int:
        p = request.params
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        return self._start(Seq(self._id(), request.id, list(request.prompt_ids), p,
                               SeedStream(seed)))

    def step(self) -> list[Event]:
        events = []
        for s in list(self._running):
            with torch.no_grad():
                logits = self.model(torch.tensor([s.prompt + s.tokens])).logits[:, -1]
            u = [s.rng.next()] if s.params.temperature > 0 else [0.0]
            tok, lp, ent, logp = sample(logits, [s.params], u)
            t = int(tok[0])
            s.tokens.append(t)
            s.logprobs.append(float(lp[0]))
            s.entropies.append(float(ent[0]))
            s.versions.append(self.version)
            if s.params.top_logprobs:
                vals, idx = logp[0].topk(s.params.top_logprobs)
                s.top.append(list(zip(idx.tolist(), vals.tolist())))
            self.tokens_generated += 1
            if t in s.params.stop_ids:
                s.finish = "stop"
            elif len(s.tokens) >= s.params.max_new_tokens:
                s.finish = "length"
            if s.finish or len(s.tokens) - s.emitted >= self.segment:
                events.append(self._event(s))
        self._running = [s for s in self._running if not s.finish]
        return events

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def stream(self):
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[Request]) -> list[Completion]:
        seqs = [self._get(self.add(r)) for r in requests]
        for _ in self.stream():
            pass
        return [s.completion() for s in seqs]

    def load_weights(self, weights, version: int) -> None:
        own = self.weight_tensors()
        with torch.no_grad():
            for name, value in weights.items():
                if name not in own:
                    raise KeyError(f"load_weights: {name} is not a weight of this model")
                if isinstance(value, torch.Tensor):
                    own[name].copy_(value)
                else:
                    _scatter(name, own[name], *SparseUpdate(*value))
        self.weights_written(version)

    # SequenceControl
    def fork(self, seq_id: int, n: int, *, seeds=None, params=None, last_tokens=None):
        if last_tokens is not None:
            raise NotImplementedError("the reference engine forks at a sequence's end only")
        parent = self._get(seq_id)
        out = []
        for i in range(n):
            seed = seeds[i] if seeds is not None else self._seeds.getrandbits(63)
            kid = Seq(self._id(), parent.request_id, parent.prompt, params or parent.params,
                      SeedStream(seed), list(parent.tokens), list(parent.logprobs),
                      list(parent.entropies), list(parent.versions), list(parent.top),
                      emitted=len(parent.tokens))
            out.append(self._start(kid))
        return out

    def pause(self, seq_id: int) -> Completion:
        s = self._stop(seq_id, "paused")
        self._paused[seq_id] = s
        return s.completion()

    def resume(self, seq_id: int) -> None:
        s = self._paused.pop(seq_id)
        s.finish = None
        self._running.append(s)

    def abort(self, seq_id: int) -> Completion:
        return self._stop(seq_id, "abort").completion()

    # Weights and state
    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def weights_written(self, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict:
        return {"seeds": self._seeds.getstate(), "next_id": self._next}

    def load_state_dict(self, state: dict) -> None:
        self._seeds.setstate(state["seeds"])
        self._next = state["next_id"]

    # plumbing
    def _id(self) -> int:
        self._next += 1
        return self._next - 1

    def _start(self, s: Seq) -> int:
        self._running.append(s)
        return s.seq_id

    def _get(self, seq_id: int) -> Seq:
        return next(s for s in self._running + list(self._paused.values())
                    if s.seq_id == seq_id)

    def _stop(self, seq_id: int, why: str) -> Seq:
        s = self._get(seq_id)
        self._running.remove(s)
        s.finish, s.emitted = why, len(s.tokens)
        return s

    @staticmethod
    def _event(s: Seq) -> Event:
        a, s.emitted = s.emitted, len(s.tokens)
        return Event(s.seq_id, s.request_id, s.tokens[a:], s.logprobs[a:], s.entropies[a:],
                     s.versions[a:], s.finish is not None, s.finish, s.top[a:] or None)
