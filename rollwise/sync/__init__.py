"""Weight sync from the trainer to the rollout engine: full payloads, and SparseRL-Sync sparse
payloads (only the elements whose stored value changed, exactly), verified by version and
checksum, in-process, to an engine in a child process through shared memory or a socket, or to
Ray workers through the object store (the engine gives its transport: Engine.sync_transport).

    engine = build_engine(cfg, model)   # rollwise.engine.backends; sync.transport picks where
    sync = build_sync(cfg.sync, trainer, engine)
    trainer.update(groups); metrics = sync.push()
"""

from rollwise.sync.errors import (
           ChecksumError,
           CorruptPayloadError,
           EngineProcessError,
           StaleEngineError,
           SyncError,
           WeightMismatchError,
)
from rollwise.sync.receiver import Receiver
from rollwise.sync.sender import Sender
from rollwise.sync.transport import InProcessTransport, ProcessTransport
from rollwise.sync.weight_sync import WeightSync, build_sync

__all__ = ["ChecksumError", "CorruptPayloadError", "EngineProcessError",
           "InProcessTransport", "ProcessTransport", "Receiver", "Sender", "StaleEngineError",
           "SyncError", "WeightMismatchError", "WeightSync", "build_sync"]
