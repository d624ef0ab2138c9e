"""The verifier protocol: score a batch of responses into named reward channels, with reasons.

A verifier gets `Item`s (the decoded response, its problem, the answer the configured
extractor found, the token count and the index of its group in the batch) and returns one
`Verdict` per item. `isolated` verifiers (math-verify, code, user functions) run one item at a
time in worker processes with a per-sample timeout; the others run in-process on the batch.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any

from rollwise.types import Problem

# why a verifier could not score a sample (metric: filter/failed/<cause>)
TIMEOUT, CRASH, ERROR, BAD_OUTPUT = "timeout", "crash", "error", "bad_output"
DEADLINE = "deadline"  # not scored: the whole batch's time (an evaluation's) ran out
MAX_INFO_CHARS = 2_000  # a verdict's info (a reward's own, or a failure's reason) is cut here
# a verdict's channels are kept with every sample, logged and written to the store: a reward
# returning 100,000 of them would grow the run by gigabytes, so past these it fails the sample
MAX_CHANNELS, MAX_CHANNEL_NAME_CHARS = 64, 100


def clipped(info: Any) -> str:
    """`info` as text of at most MAX_INFO_CHARS (and a note of how long it was): a reward's
    info is kept with every sample, so one verifier's 10 MB info must not be."""
    text = info if isinstance(info, str) else str(info)
    if len(text) <= MAX_INFO_CHARS:
        return text
    note = f" ... [{len(text)} characters, cut]"
    return text[:MAX_INFO_CHARS - len(note)] + note


@dataclass
class Item:
    text: str  # the decoded response
    problem: Problem
    answer: str | None = None  # what the configured extractor found in `text`
    num_tokens: int = 0
    group: int = 0  # samples with the same value are one prompt's group
    meta: dict = field(default_factory=dict)  # the sample's meta (an episode's env reward)


@dataclass
class Verdict:
    rewards: dict[str, float] = field(default_factory=dict)  # named channels
    info: str = ""  # extracted answer, test results, or why it failed
    failed: str | None = None  # a cause (TIMEOUT, CRASH, ERROR, BAD_OUTPUT, ...) or None

    @classmethod
    def failure(cls, cause: str, info: str) -> "Verdict":
        return cls({}, clipped(info), cause)


class Verifier(abc.ABC):
    """A verifier; a user's class that does not subclass it gets these defaults when it is
    loaded (rollwise.registry.conform)."""

    name: str = ""  # the channel it fills
    isolated: bool = False  # True: one item at a time in a worker process, with a timeout
    in_worker: bool = False  # set in a worker process (the pool times it out, not itself)
    user_code: bool = False  # a user's function or class: no time limit of its own

    @abc.abstractmethod
    def score(self, items: list[Item]) -> list[Verdict]: ...

    def metrics(self) -> dict[str, float]:
        """Batch-level numbers from the last `score` call (e.g. the majority ratio)."""
        return {}

    def attach(self, engine, tokenizer) -> None:
        """An engine to generate with (the judge), e.g. the policy's own."""

    def warm(self) -> None:
        """Imports and set-up a worker does before it reports ready (never timed)."""


def coerce(out: Any, channel: str) -> Verdict:
    """Turn what a verifier (or user function) returned into a Verdict, or a BAD_OUTPUT one.

    Accepted: a Verdict, a number, (number, info), or a dict of channel -> number (the
    verifier's own channel must be among them). Non-finite numbers are garbage."""
    if isinstance(out, Verdict):
        verdict = out
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], str):
        verdict = Verdict({channel: out[0]}, out[1])
    elif isinstance(out, dict):
        verdict = Verdict(dict(out), "")
    elif isinstance(out, (int, float)) and not isinstance(out, bool):
        verdict = Verdict({channel: out}, "")
    elif isinstance(out, bool):
        verdict = Verdict({channel: float(out)}, "")
    else:
        return Verdict.failure(BAD_OUTPUT, f"{channel}: returned {type(out).__name__} "
                                           f"{str(out)[:80]!r}, expected a number")
    if verdict.failed:
        return Verdict.failure(verdict.failed, verdict.info)
    too_many = _channels_out_of_bounds(verdict.rewards)
    if too_many:
        return Verdict.failure(BAD_OUTPUT, f"{channel}: {too_many}")
    try:
        rewards = {str(k): float(v) for k, v in verdict.rewards.items()}
    except (TypeError, ValueError) as e:
        return Verdict.failure(BAD_OUTPUT, f"{channel}: non-numeric reward ({e})")
    bad = [k for k, v in rewards.items() if not math.isfinite(v)]
    if bad or channel not in rewards:
        what = f"non-finite {bad}" if bad else f"no {channel!r} channel in {sorted(rewards)}"
        return Verdict.failure(BAD_OUTPUT, f"{channel}: {what}")
    return Verdict(rewards, clipped(verdict.info))


def _channels_out_of_bounds(rewards) -> str | None:
    """Why a verdict's channels are past the bounds (MAX_CHANNELS, MAX_CHANNEL_NAME_CHARS),
    or None; said before any value is converted."""
    if not isinstance(rewards, dict):
        return f"rewards must be a dict of channel -> number, not {type(rewards).__name__}"
    if len(rewards) > MAX_CHANNELS:
        return (f"returned {len(rewards)} reward channels, more than {MAX_CHANNELS}; return "
                f"the few channels that train (and put the rest in the info text)")
    long = next((k for k in rewards if len(str(k)) > MAX_CHANNEL_NAME_CHARS), None)
    if long is not None:
        return (f"a reward channel's name is {len(str(long))} characters "
                f"({str(long)[:40]!r}...), more than {MAX_CHANNEL_NAME_CHARS}")
    return None


def score_checked(verifier: Verifier, items: list[Item]) -> list[Verdict]:
    """Run an in-process verifier on a batch; an exception or a wrong-length answer fails
    every item of the batch with the reason, never the run."""
    try:
        out = verifier.score(items)
    except Exception as e:
        return [Verdict.failure(ERROR, f"{verifier.name}: {type(e).__name__}: {e}")] * len(items)
    if not isinstance(out, list) or len(out) != len(items):
        n = len(out) if isinstance(out, list) else type(out).__name__
        return [Verdict.failure(BAD_OUTPUT, f"{verifier.name}: returned {n} verdicts "
                                            f"for {len(items)} samples")] * len(items)
    return [coerce(v, verifier.name) for v in out]
