"""User verifiers for tests/test_filter_*.py, named by import path ('filter_userfns:flaky').

Kept free of heavy imports (no torch): the Filter stage's worker processes import this
module by name, and every fresh worker pays for what it imports."""

from __future__ import annotations

import os
import time

from rollwise.stages.filter.base import Verdict


def flaky(response: str, problem):
    """Misbehaves on command: hangs, dies, raises, returns garbage or a huge info."""
    if response == "hang":
        time.sleep(600)
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise ValueError("boom")
    if response == "garbage":
        return "not a number"
    if response == "nan":
        return float("nan")
    if response == "huge":  # a 10 MB info with a good reward
        return 1.0, "i" * (10 << 20)
    if response == "huge-raise":
        raise ValueError("e" * (10 << 20))
    if response == "many-channels":  # 100,000 named channels, the reward's among them
        return {"flaky": 1.0, **{f"c{i}": 0.5 for i in range(100_000)}}
    if response == "long-name":
        return {"flaky": 1.0, "n" * 10_000: 0.5}
    if response == "some-channels":  # within the bounds: kept
        return {"flaky": 1.0, **{f"c{i}": 0.5 for i in range(20)}}
    return float(response == problem.answer[::-1]), "checked"


class LengthChannels:
    """A user verifier class (the batch protocol) that fills two channels."""

    name = "chars"

    def score(self, items):
        return [Verdict({"chars": float(len(it.text)), "even": float(len(it.text) % 2 == 0)},
                        "counted") for it in items]


def hangs_sometimes(response: str, problem):
    """Hangs on about one non-empty response in 64, else a parity reward (the fault matrix's:
    scripts/fault_matrix.py)."""
    if response and sum(map(ord, response)) % 64 == 0:
        time.sleep(3600)
    return float(len(response) % 2), "parity"


def torch_imported(response: str, problem):
    """1 where the worker process that scores it has imported torch."""
    import sys
    return float("torch" in sys.modules), "checked"
