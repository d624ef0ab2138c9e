"""Durable file writes: write aside, fsync, rename into place, fsync the directory.

After `atomic_write(path, data)` returns, `path` holds `data` whole, across a crash or a power
loss (on a file system that honours fsync); before it returns, `path` holds its old content or
does not exist. Never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollwise.store import killpoint


def fsync_dir(path: str | Path) -> None:
    """Make a rename or unlink inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, kill_phase: str | None = None,
                  step: int = -1) -> None:
    """Write and fsync a new file (not atomic by itself: see atomic_write)."""
    with open(path, "wb") as f:
        if kill_phase:
            killpoint.write_then_kill(f, data, kill_phase, step)
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | Path, data: bytes, kill_phase: str | None = None,
                 step: int = -1) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_durable(tmp, data, kill_phase, step)
    os.replace(tmp, path)
    fsync_dir(path.parent)
