"""How a payload reaches the engine. A transport hands out the arena a payload is encoded into
(so encoding writes straight into what is moved), applies the payload on the engine's side, and
can read the engine's weights back for check mode.

- `InProcessTransport`: the engine lives in this process; the arena is a reused buffer.
- `ProcessTransport`: the engine lives in a child process on this machine (`EngineProcess`);
  the arena is a POSIX shared-memory segment both processes map, and only the small metadata
  goes through a pipe.

An engine gives its own (`Engine.sync_transport`): a Ray worker pool's puts each payload in
Ray's object store once (rollwise.engine.ray_pool.PoolTransport).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory
from typing import Protocol

import torch

from rollwise.sync.payload import PayloadMeta, entry_views, to_dtype
from rollwise.sync.receiver import Ack, EngineState, Receiver

WIRES = {"process": "shm", "socket": "socket"}  # sync.transport -> the child's Engine.wire


class Transport(Protocol):
    def state(self) -> EngineState: ...
    def alloc(self, nbytes: int) -> torch.Tensor: ...
    def apply(self, meta: PayloadMeta, arena: torch.Tensor) -> Ack: ...
    def engine_weights(self) -> dict[str, torch.Tensor]: ...


class GrowingBuffer:
    """A uint8 buffer reused across syncs: fresh memory costs page faults on every sync."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]


class InProcessTransport:
    def __init__(self, engine):
        self.receiver = Receiver(engine)
        self._buffer = GrowingBuffer()

    def state(self) -> EngineState:
        return self.receiver.state()

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self._buffer.take(nbytes)

    def apply(self, meta: PayloadMeta, arena: torch.Tensor) -> Ack:
        return self.receiver.apply(meta, arena)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self.receiver.tensors()


class SharedArena:
    """A named shared-memory segment seen as a uint8 tensor, in both processes."""

    def __init__(self, nbytes: int, name: str | None = None):
        nbytes = max(nbytes, 1)
        if name is None:
            check_shm_space(nbytes)
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=nbytes)
        self.owner = name is None
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        self.tensor = None
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the OS frees it with the last one
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def check_shm_space(nbytes: int, path: str = "/dev/shm") -> None:
    """A shared-memory segment larger than /dev/shm's free space kills the process with SIGBUS
    when touched; say so before that happens."""
    try:
        st = os.statvfs(path)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise MemoryError(f"{path} has {free / 2**20:.0f} MiB free; the weight-sync arena needs "
                          f"{nbytes / 2**20:.0f} MiB. Enlarge it (docker: --shm-size) or use "
                          f"sync.transport=inproc")


class ProcessTransport:
    """Parent side of an engine in a child process; see rollwise/engine/process.py."""

    def __init__(self, proc):
        self.proc = proc

    def state(self) -> EngineState:
        return self.proc.sync_state()

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self.proc.arena(nbytes)

    def apply(self, meta: PayloadMeta, arena: torch.Tensor) -> Ack:
        return self.proc.apply(meta)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        spec = self.state().spec
        meta, arena = self.proc.export()
        views = entry_views(meta, arena)
        return {n: views[n][0].clone().view(s.shape) if n in views
                else torch.empty(s.shape, dtype=to_dtype(s.dtype)) for n, s in spec.items()}
