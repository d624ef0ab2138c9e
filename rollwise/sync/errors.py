"""Weight-sync failures. Each says what the engine holds and what to do; none is silent."""


class SyncError(RuntimeError):
    """A payload could not be applied; the engine must get a full sync before it generates."""


class StaleEngineError(SyncError):
    """The engine is not at the version a sparse payload applies to (it restarted, was loaded by
    someone else, or missed a sync). The engine refused it; send a full sync."""


class ChecksumError(SyncError):
    """After applying a payload, the engine's weights do not match the trainer's checksum."""


class CorruptPayloadError(SyncError):
    """The payload does not fit the engine's model (names, shapes, dtypes, index range)."""


class WeightMismatchError(SyncError):
    """Check mode: the engine's weights differ bit for bit from the trainer's."""


class EngineProcessError(RuntimeError):
    """The engine's child process failed or died."""


BY_NAME = {c.__name__: c for c in (SyncError, StaleEngineError, ChecksumError,
                                   CorruptPayloadError, WeightMismatchError)}
