"""Checkpoints: the whole state of a run at the end of a step, written atomically.

    runs/<name>/checkpoints/step-000010/state.pt    torch.save of Run.state_dict()
                                       /meta.json   step, size and SHA-256 of state.pt

A checkpoint is written into a hidden temporary folder (each file fsynced), which is then
renamed into place (the parent fsynced), so `step-*` folders are always complete; a crash
mid-write leaves only a `.tmp-*` folder, removed on the next resume. Only the last K are kept.
Loading checks the SHA-256 and falls back to the newest checkpoint that passes.

state.pt is a pickle (it holds RNG states and sampler state next to the tensors): load only
checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rollwise.store import killpoint
from rollwise.store.fsio import fsync_dir, write_durable

FORMAT = 1


@dataclass
class Checkpoint:
    step: int
    path: Path

    def load(self) -> dict:
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=False)


def root_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: str | Path, step: int, state: dict, keep: int = 2) -> Checkpoint:
    """Write `state` as the checkpoint of `step`, then keep only the newest `keep`."""
    root = root_of(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    size, digest = _write_state(tmp / "state.pt", state, step)
    meta = {"format": FORMAT, "step": step, "bytes": size, "sha256": digest,
            "time": time.time()}
    write_durable(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    if final.exists():  # a newer checkpoint than the one resumed from failed its check
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    prune(run_dir, keep)
    return Checkpoint(step, final)


class _Hashing:
    """A binary file that hashes and counts what is written through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_state(path: Path, state: dict, step: int) -> tuple[int, str]:
    """torch.save straight to the file, fsynced: no copy of the state in memory (a BytesIO
    of it and its getvalue() held two more, 1.7 GiB at SmolLM2's final step). Returns its
    size and SHA-256. The crash hook leaves it half written, as a kill mid-write would."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        torch.save(state, out)
        f.flush()
        if killpoint.armed("checkpoint", step):
            f.truncate(out.size // 2)
            os.fsync(f.fileno())
            killpoint.kill()
        os.fsync(f.fileno())
    return out.size, out.sha.hexdigest()


def problem(path: Path) -> str | None:
    """Why the checkpoint folder cannot be loaded, or None when it is intact."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        data = (path / "state.pt").read_bytes()
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, this version reads {FORMAT}"
    if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        return f"state.pt has {len(data)} bytes or a checksum that differs from meta.json"
    return None


def listing(run_dir: str | Path) -> list[Checkpoint]:
    """Every checkpoint folder, oldest first (intact or not)."""
    root = root_of(run_dir)
    if not root.exists():
        return []
    return sorted((Checkpoint(int(p.name[5:]), p) for p in root.glob("step-*")
                   if p.name[5:].isdigit()), key=lambda c: c.step)


def latest(run_dir: str | Path, log=print) -> Checkpoint | None:
    """The newest intact checkpoint; damaged newer ones are reported and skipped."""
    for ckpt in reversed(listing(run_dir)):
        why = problem(ckpt.path)
        if why is None:
            return ckpt
        log(f"checkpoint {ckpt.path} is damaged ({why}); trying an older one")
    return None


def clean(run_dir: str | Path, after_step: int, log=print) -> None:
    """Remove interrupted writes and the checkpoints newer than `after_step` (damaged ones:
    the resume continues from `after_step`), saying which went and why."""
    root = root_of(run_dir)
    for p in sorted(root.glob(".tmp-*")):
        log(f"discarded {p.name}: a checkpoint whose write was interrupted before it was "
            f"complete (the run continues from step {after_step})")
        shutil.rmtree(p)
    for c in listing(run_dir):
        if c.step > after_step:
            log(f"discarded {c.path.name}: newer than the checkpoint resumed from "
                f"({problem(c.path) or 'the run resumes from an older one'})")
            shutil.rmtree(c.path)
    if root.exists():
        fsync_dir(root)


def prune(run_dir: str | Path, keep: int) -> None:
    for ckpt in listing(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpt.path)


# ------------------------------------------------------------------------------ RNG state

def rng_state(run_rng: random.Random) -> dict:
    """Every global generator, plus the run's own Random."""
    np_state = np.random.get_state()
    return {"run": run_rng.getstate(), "python": random.getstate(),
            "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict, run_rng: random.Random) -> None:
    run_rng.setstate(state["run"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def engine_state(engine) -> dict | None:
    """The engine's own state (its request-seed stream: requests without a seed draw from it);
    None for an engine that keeps none."""
    return engine.state_dict() or None


def set_engine_state(engine, state: dict | None) -> bool:
    """Restore engine_state's result; False when there is none (then sampling after the
    resume differs from an uninterrupted run)."""
    if not state:
        return False
    engine.load_state_dict(state)
    return True


# ---------------------------------------------------------------------------- the trainer

def trainer_state(trainer) -> dict:
    """Model, optimizer, scheduler, policy version, kept snapshots and reference model."""
    return trainer.state_dict()


def set_trainer_state(trainer, state: dict) -> None:
    trainer.load_state_dict(state)


# ------------------------------------------------------------------------------- Ctrl-C

class StopOnInterrupt:
    """The first Ctrl-C (SIGINT) or SIGTERM (what Slurm and Kubernetes send before they kill)
    asks the loop to finish its step, checkpoint and stop; a second one interrupts at once.
    `signum` is the signal that asked (the process then exits 128 + signum). A no-op outside
    the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log=print):
        self.log, self.signum, self._previous = log, None, {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.signum = signum
        self.log(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                 f"(send it again to stop at once, losing the step)")

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
