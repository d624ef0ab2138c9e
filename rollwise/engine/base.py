"""The engine's contract: its records (Request, Completion, SparseUpdate), the `Engine` base
class, and Protocols for what only some engines do. The built-in engine, an engine in a child
process, the Ray worker pool and the vLLM backend all subclass `Engine`, and
tests/engine_contract.py checks each against the model itself. Token in, token out: the engine
knows nothing about text.

- `Engine`: submit requests and step them (events every `segment` tokens and at each end),
  or run a batch to the end; every token carries its behaviour log-probability and the policy
  version of the weights that sampled it. Its other methods have defaults (no prefix cache,
  nothing to release, no metrics, no state), so the loop calls them on any engine.
- `SequenceControl`: what an in-flight controller or a tree does between events.
- `Weights`: where weight sync writes (full or sparse payloads, in place) and how a new version
  takes effect; `load_weights` is the one-call form of the same. After `use_adapters` (LoRA)
  those tensors are the adapters, merged into the weights when a sync ends.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from rollwise.engine.sampling import SamplingParams
from rollwise.engine.scheduler import Event
from rollwise.sync.transport import InProcessTransport, Transport


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: Any = -1  # the caller's tag, returned in events and completions


@dataclass
class Completion:
    request_id: Any
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (the stop id ends token_ids), "length", "abort" or "paused"
    seq_id: int = -1
    parent: int | None = None  # the seq_id this was forked from
    branch_point: int = 0  # token_ids[:branch_point] were inherited from the parent
    top_logprobs: list[list[tuple[int, float]]] | None = None
    hidden: torch.Tensor | None = None  # last hidden state of the last token


class SparseUpdate(NamedTuple):
    """New values at flat indices of one tensor (SparseRL-Sync): replaced, never added."""

    indices: torch.Tensor  # (nnz,) int
    values: torch.Tensor  # (nnz,)


class Engine(abc.ABC):
    version: int = -1  # stamped on every token sampled from now on; -1: weights unknown
    tokens_generated: int = 0
    answers_finished: int = 0  # sequences run to their end; progress notes read it
    prefix_tokens_saved: int = 0  # prompt tokens a prefix cache or a fork spared prefilling
    # prompt and resumed tokens run through the model; None where the engine does not count
    prefill_tokens: int | None = None
    wire: str | None = None  # how payloads reach it: None here, 'shm'/'socket' a child process
    # pause(keep=True) holds a sequence's K/V for its resume, across weight syncs: the built-in
    # engine (in this process or a child); the Ray pool and vLLM prefill a resumed one again
    can_keep_paused: bool = False

    @abc.abstractmethod
    def add(self, request: Request) -> int:
        """Queue a request; returns its seq_id (events, fork, pause, abort name it)."""

    @abc.abstractmethod
    def step(self) -> list[Event]:
        """Advance every running sequence; events for those due one."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to the end on an idle engine; completions in request order.
        Default: add them and step to the end, each completion assembled from its events."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; requests are in flight")
        seq_ids = [self.add(r) for r in requests]
        out = {s: Completion(r.id, [], [], [], [], "length", s) for s, r in zip(seq_ids, requests)}
        while self.has_unfinished():
            for ev in self.step():
                c = out[ev.seq_id]
                c.token_ids += ev.token_ids
                c.logprobs += ev.logprobs
                c.entropies += ev.entropies
                c.versions += ev.versions
                if ev.finished:
                    c.finish_reason = ev.finish_reason or "length"
        return [out[s] for s in seq_ids]

    def load_weights(self, weights: Mapping[str, torch.Tensor | SparseUpdate | tuple],
                     version: int) -> None:
        """Full tensors or sparse (indices, values) updates, then `version` from now on."""
        raise NotImplementedError(f"{type(self).__name__} takes weights only through its "
                                  "weight sync (rollwise.sync)")

    def reset_prefix_cache(self) -> None:
        """Forget cached K/V, so a round's numbers never depend on an earlier round."""

    def sleep(self) -> None:
        """Free the accelerator memory generation holds while the trainer runs (vLLM)."""

    def release_idle_memory(self) -> bool:
        """With nothing waiting, running or paused, give back the memory generation holds
        (the built-in engine's K/V cache on a CPU) so the update can use it; it is allocated
        again at the next pass. Whether anything was released."""
        return False

    def close(self) -> None:
        """Release what the engine holds (a child process, Ray actors, a vLLM server)."""

    def metrics(self) -> dict[str, float]:
        """The engine's own numbers for a step's metrics line (a worker pool's faults)."""
        return {}

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the engine (its request-seed stream)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def use_adapters(self, spec) -> None:
        """From now on weight sync sends LoRA adapters (an AdapterSpec,
        rollwise/engine/adapters.py) for the engine to apply to the weights it holds now."""
        raise NotImplementedError(f"train.lora: {type(self).__name__} cannot apply LoRA "
                                  f"adapters (no use_adapters); use engine.backend=builtin or "
                                  f"vllm, or train.lora.rank=0")

    def sync_transport(self) -> Transport:
        """How the weight sync reaches this engine (rollwise.sync.transport): in this
        process by default; a child process through shared memory or a socket; a Ray
        worker pool through Ray's object store."""
        return InProcessTransport(self)


@runtime_checkable
class SequenceControl(Protocol):
    def fork(self, seq_id: int, n: int, *, seeds: list[int] | None = None,
             params: SamplingParams | None = None,
             last_tokens: list[int] | None = None) -> list[int]:
        """n children sharing the sequence's prefix; returns their seq_ids."""

    def pause(self, seq_id: int) -> Completion:
        """Stop and free it, keeping it for `resume` (finish_reason 'paused'). An engine with
        can_keep_paused also takes keep=True: its K/V stays for the resume."""

    def resume(self, seq_id: int) -> None:
        """Continue a paused sequence (a kept one from its K/V, else re-prefilled under the
        current weights)."""

    def abort(self, seq_id: int) -> Completion:
        """Stop and free it for good (finish_reason 'abort')."""


@runtime_checkable
class Weights(Protocol):
    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors generation reads, by Hugging Face name, for in-place writes."""

    def weights_written(self, version: int) -> None:
        """The tensors were written (and verified): use them from now on, as `version`."""
