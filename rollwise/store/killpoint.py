"""Crash-test hook: make the process kill itself (SIGKILL) at a chosen point of a chosen step.

    ROLLWISE_KILL_AT=train:4 rollwise train ...    # dies inside step 4's optimizer update

Phases (several may be given, comma separated; the first one reached fires):
    generate    during generation: the second engine forward pass of the step
    wal         mid-way through writing the rollout store's write-ahead log
    store       the write-ahead log is durable, the Parquet file half written
    train       after the first optimizer step of the update (the model half updated)
    checkpoint  the checkpoint's state file half written

Unset (normal use), every check is one environment lookup. tests/loop/test_crash_resume.py and
`rollwise bench crash` use it to check that a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
from typing import NoReturn

ENV = "ROLLWISE_KILL_AT"
PHASES = ("generate", "wal", "store", "train", "checkpoint")


def _points() -> set[tuple[str, int]]:
    out = set()
    for part in filter(None, os.environ.get(ENV, "").split(",")):
        phase, _, step = part.strip().partition(":")
        if phase not in PHASES or not step.isdigit():
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: use <phase>:<step>[,...] with a "
                             f"phase from {', '.join(PHASES)}")
        out.add((phase, int(step)))
    return out


def armed(phase: str, step: int) -> bool:
    return ENV in os.environ and (phase, step) in _points()


def kill() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached


def maybe_kill(phase: str, step: int) -> None:
    if armed(phase, step):
        kill()


def write_then_kill(f, data: bytes, phase: str, step: int) -> None:
    """Write `data` to the open binary file f, or, when armed, half of it (flushed) and die."""
    if armed(phase, step):
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        kill()
    f.write(data)


def instrument(run) -> None:
    """Arm the points inside parts this package does not own: the engine's forward passes and
    the optimizer. Only when the variable is set; reads run.current_step (the step generating)
    and run.train_step (the step training; the same step in the synchronous loop)."""
    if ENV not in os.environ:
        return
    points = _points()
    if any(p == "generate" for p, _ in points):
        engine_step, calls = run.engine.step, {}

        def step_then_maybe_kill(*args, **kwargs):
            s = run.current_step
            calls[s] = calls.get(s, 0) + 1
            if calls[s] == 2:
                maybe_kill("generate", s)
            return engine_step(*args, **kwargs)
        run.engine.step = step_then_maybe_kill
    if any(p == "train" for p, _ in points) and hasattr(run.trainer, "optimizer"):
        run.trainer.optimizer.register_step_post_hook(
            lambda *_: maybe_kill("train", run.train_step))
