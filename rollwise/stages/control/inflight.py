"""In-flight control: decisions about requests while they generate, over any generator.

The rollout driver (rollwise.stages.generate.rollout) shows the controller every engine event
(every `engine.segment` tokens of a sequence and at its end) and applies its answer:

    Decision()                                  continue
    Decision("pause", "why")                    stop this sequence, keep it for a later step
    Decision("abort", "why")                    stop it for good (it is trained as it stands)
    Decision("abort", "why", keep=k)            the same, its response cut to k tokens
    Decision("fork", "why", n=2)                two children sharing its prefix join its group
    Decision("fork", "why", n=1, tokens=(t,))   a child whose latest token is t instead (chosen,
                                                not sampled: Sample.chosen records it)
    Decision("pause", "why", everyone=True)     end the round: every unfinished sequence pauses

Each decision other than continue is counted in the ledger as control/<action>/<reason>.
A controller deciding for a whole group at once applies a decision to another live sample with
rollout.decide_for(sample, decision). Hooks with defaults (InflightController, below):

    bind(policy=, tokenizer=, task=, prompter=, profile=)   the run's context, once
    allocate(problems, sizes) -> sizes      samples per prompt before generation (0: skip)
    observe(scored_groups, step)            after scoring: learn from the rewards
    metrics() -> dict                       numbers for this step's metrics line

`control.inflight` picks a controller by name: none (RunToEnd, below), april
(rollwise.stages.control.april), arrol (prune_arrol.py), duet (abort_duet.py), or
'package.module:factory' called as factory(cfg).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from rollwise import registry
from rollwise.engine import Event
from rollwise.types import Group, Problem, Sample

ACTIONS = ("continue", "pause", "abort", "fork")


@dataclass(frozen=True)
class Decision:
    action: str = "continue"
    reason: str = ""
    n: int = 0  # children, for fork
    everyone: bool = False  # pause/abort: every unfinished sequence, ending the round
    tokens: tuple[int, ...] | None = None  # fork: each child's replacement for the latest token
    keep: int | None = None  # abort: the response is cut to its first `keep` tokens, so a
    # limit named in tokens holds at that token, not at the next event (engine.segment)

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"in-flight decision {self.action!r}: one of {', '.join(ACTIONS)}")
        if self.action == "fork" and (self.n < 1 or self.everyone):
            raise ValueError("a fork decision needs n >= 1 children and applies to one sequence")
        if self.tokens is not None and (self.action != "fork" or len(self.tokens) != self.n):
            raise ValueError(f"Decision(tokens=...) names each fork child's token: give n = "
                             f"{self.n} of them, on a fork decision")
        if self.keep is not None and (self.action != "abort" or self.keep < 0):
            raise ValueError("Decision(keep=n) cuts an aborted response to n >= 0 tokens")
        if self.action != "continue" and not self.reason:
            raise ValueError(f"a {self.action} decision needs a reason (the ledger counts it)")


CONTINUE = Decision()


class InflightController(abc.ABC):
    """`rollout` below is the round's rollwise.stages.generate.rollout.Rollout."""

    @abc.abstractmethod
    def begin(self, want: int, step: int) -> tuple[list[Group], int]:
        """A round of `want` groups starts: groups carried from earlier rounds (resumed
        first) and how many new prompts to start."""

    @abc.abstractmethod
    def on_event(self, event: Event, sample: Sample, rollout) -> Decision:
        """An event of `sample` (its tokens are appended already): what to do now."""

    @abc.abstractmethod
    def end(self, rollout, want: int) -> list[Group]:
        """The round is over: the groups to score and train now; the controller keeps any
        others it wants to continue later (its state_dict saves them)."""

    def bind(self, **context) -> None:
        """The run's context, once: policy=, tokenizer=, task=, prompter=, profile=."""

    def allocate(self, problems: list[Problem], sizes: list[int]) -> list[int]:
        """Samples per prompt before generation (0: skip it); default: as sized."""
        return sizes

    def observe(self, scored: list[Group], step: int) -> None:
        """After scoring, every scored group: learn from the rewards."""

    def metrics(self) -> dict[str, float]:
        """Numbers for this step's metrics line."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class RunToEnd(InflightController):
    """control.inflight = none: every request runs to its end; the round returns every group."""

    def __init__(self, cfg=None):
        pass

    def begin(self, want: int, step: int) -> tuple[list[Group], int]:
        return [], want

    def on_event(self, event, sample, rollout) -> Decision:
        return CONTINUE

    def end(self, rollout, want: int) -> list[Group]:
        return list(rollout.groups)


def build_inflight(cfg) -> InflightController:
    """The controller `control.inflight` names (cfg: the run's Config)."""
    factory = registry.resolve("inflight", cfg.control.inflight, "control.inflight")
    return registry.conform(factory(cfg), InflightController, "control.inflight")
