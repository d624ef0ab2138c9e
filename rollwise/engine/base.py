"""The engine's contract as Protocols: the built-in Engine, an Engine in a child process and the
vLLM backend all satisfy them, and tests/engine_contract.py checks each against the model
itself. Token in, token out: the engine knows nothing about text.

- `Engine`: submit requests and step them (events every `segment` tokens and at each end),
  or run a batch to the end; every token carries its behaviour log-probability and the policy
  version of the weights that sampled it.
- `SequenceControl`: what an in-flight controller or a tree does between events.
- `Weights`: where weight sync writes (full or sparse payloads, in place) and how a new version
  takes effect; `load_weights` is the one-call form of the same.
- `Stateful`: the engine's own state for checkpoints (its request-seed stream).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from rollwise.engine.engine import Completion, Request, SparseUpdate
from rollwise.engine.sampling import SamplingParams
from rollwise.engine.scheduler import Event


@runtime_checkable
class Engine(Protocol):
    version: int  # stamped on every token sampled from now on; -1: weights unknown
    tokens_generated: int

    def add(self, request: Request) -> int:
        """Queue a request; returns its seq_id (events, fork, pause, abort name it)."""

    def step(self) -> list[Event]:
        """Advance every running sequence; events for those due one."""

    def has_unfinished(self) -> bool: ...

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to the end on an idle engine; completions in request order."""

    def load_weights(self, weights: Mapping[str, torch.Tensor | SparseUpdate | tuple],
                     version: int) -> None:
        """Full tensors or sparse (indices, values) updates, then `version` from now on."""


@runtime_checkable
class SequenceControl(Protocol):
    def fork(self, seq_id: int, n: int, *, seeds: list[int] | None = None,
             params: SamplingParams | None = None,
             last_tokens: list[int] | None = None) -> list[int]:
        """n children sharing the sequence's prefix; returns their seq_ids."""

    def pause(self, seq_id: int) -> Completion:
        """Stop and free it, keeping it for `resume` (finish_reason 'paused')."""

    def resume(self, seq_id: int) -> None:
        """Queue a paused sequence again (re-prefill under the current weights)."""

    def abort(self, seq_id: int) -> Completion:
        """Stop and free it for good (finish_reason 'abort')."""


@runtime_checkable
class Weights(Protocol):
    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors generation reads, by Hugging Face name, for in-place writes."""

    def weights_written(self, version: int) -> None:
        """The tensors were written (and verified): use them from now on, as `version`."""


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
