"""Engine side of weight sync: applies payloads into the engine's model tensors in place.

A sparse payload applies only to the exact weights it was built against: the receiver checks
that the engine is at the payload's base version *and* holds the weights the payload names as
its base (the digest of their checksums, recorded at the last verified sync). An engine that
restarted, failed a sync, or was loaded through another path refuses and asks for a full sync.
After applying, it recomputes the checksum of every tensor and compares it with the trainer's;
on any failure past the first write it sets `engine.version = -1`, so no token is ever stamped
with a version the weights do not have.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rollwise.sync import coding, context_coding
from rollwise.sync.errors import ChecksumError, CorruptPayloadError, StaleEngineError, SyncError
from rollwise.sync.payload import (
    Item,
    PayloadMeta,
    TensorSpec,
    bits,
    checksum,
    dtype_name,
    entry_views,
    plan,
    specs,
    unique_tensors,
)


@dataclass
class EngineState:
    spec: dict[str, TensorSpec]  # the engine's tensors, one name per storage
    version: int
    held: str | None  # digest of the weights of the last verified payload; None: unknown


@dataclass
class Ack:
    version: int
    seconds: dict[str, float] = field(default_factory=dict)


class Receiver:
    def __init__(self, engine):
        self.engine = engine
        self.held: str | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The engine's weights, read afresh each time (the engine may rebuild its model)."""
        return unique_tensors(self.engine.weight_tensors())

    def state(self) -> EngineState:
        return EngineState(specs(self.tensors()), self.engine.version, self.held)

    def apply(self, meta: PayloadMeta, arena: torch.Tensor) -> Ack:
        t0 = time.perf_counter()
        own = self.tensors()
        self._check_base(meta)
        self._check_fits(meta, own)
        self.held = None  # until the result is verified
        try:
            with torch.no_grad():
                coded = {e.name: e.coded for e in meta.entries if e.coded}
                for name, (values, indices) in entry_views(meta, arena).items():
                    flat = own[name].view(-1)
                    if name in coded:
                        decode = context_coding.apply if isinstance(
                            coded[name], context_coding.ContextCoded) else coding.apply
                        decode(bits(flat), values, coded[name])
                    elif indices is None:
                        flat.copy_(values)
                    else:
                        flat.index_copy_(0, indices.long(), values)
            t1 = time.perf_counter()
            self._verify(meta, own)
            self.engine.weights_written(meta.version)
        except Exception as e:
            self.engine.version = -1  # the weights are now neither the old nor the new version
            reset = getattr(self.engine, "reset_prefix_cache", None)
            if reset is not None:  # nor is K/V kept under the old ones of any use
                reset()
            if isinstance(e, SyncError):
                raise
            raise CorruptPayloadError(f"applying the payload for version {meta.version} failed "
                                      f"({type(e).__name__}: {e}); send a full sync") from e
        self.held = meta.digest
        t2 = time.perf_counter()
        return Ack(meta.version, {"apply": t1 - t0, "verify": t2 - t1})

    def export(self, alloc) -> tuple[PayloadMeta, torch.Tensor]:
        """The engine's weights as a full payload (for check mode across processes)."""
        own = self.tensors()
        items = [Item(n, dtype_name(t.dtype), t.numel(), False) for n, t in own.items()]
        meta = plan(items, kind="full", sender="engine", base_version=None,
                    version=self.engine.version, bucket_bytes=2**62)
        arena = alloc(meta.nbytes)
        for name, (values, _) in entry_views(meta, arena).items():
            values.copy_(own[name].reshape(-1))
        return meta, arena

    def _check_base(self, meta: PayloadMeta) -> None:
        if meta.kind == "full":
            return
        if meta.kind != "sparse":
            raise CorruptPayloadError(f"unknown payload kind {meta.kind!r}")
        if self.engine.version != meta.base_version or self.held != meta.base_digest:
            why = ("it has had no verified sync since it started or since a failed one"
                   if self.held is None else "its weights are not the payload's base"
                   if self.engine.version == meta.base_version else "versions differ")
            raise StaleEngineError(
                f"the engine holds version {self.engine.version}, the sparse payload applies to "
                f"version {meta.base_version} ({why}): a full sync is needed")

    def _check_fits(self, meta: PayloadMeta, own: dict[str, torch.Tensor]) -> None:
        """Everything that can be checked before the first write, so a bad payload leaves the
        engine untouched."""
        names = {e.name for e in meta.entries}
        unknown = sorted(names - set(own))
        if unknown:
            raise CorruptPayloadError(f"the payload names tensors the engine does not have: "
                                      f"{unknown[:5]}")
        if meta.kind == "full":
            missing = sorted(n for n, t in own.items() if t.numel() and n not in names)
            if missing:
                raise CorruptPayloadError(f"the full payload lacks tensors {missing[:5]}; "
                                          f"they would stay stale")
        for e in meta.entries:
            t, bucket = own[e.name], meta.buckets[e.bucket]
            if not t.is_contiguous():
                raise CorruptPayloadError(f"{e.name}: the engine's tensor is not contiguous")
            if e.coded is not None:
                self._check_coded(e, t, bucket)
                continue
            if dtype_name(t.dtype) != bucket.dtype:
                raise CorruptPayloadError(f"{e.name}: engine dtype {t.dtype}, payload dtype "
                                          f"{bucket.dtype}")
            if (bucket.index_dtype is None and e.count != t.numel()) or e.count > t.numel():
                raise CorruptPayloadError(f"{e.name}: {e.count} values for {t.numel()} "
                                          f"elements")

    @staticmethod
    def _check_coded(e, t: torch.Tensor, bucket) -> None:
        c = e.coded
        if not bucket.coded or c.width != t.element_size() or c.nbytes != e.count:
            raise CorruptPayloadError(f"{e.name}: a coded blob of {e.count} bytes for "
                                      f"{c.width}-byte elements does not fit the engine's "
                                      f"{t.dtype} tensor (or its header)")
        if c.changes > t.numel():
            raise CorruptPayloadError(f"{e.name}: {c.changes} changes for {t.numel()} elements")

    def _verify(self, meta: PayloadMeta, own: dict[str, torch.Tensor]) -> None:
        if meta.checksums is None:
            return
        bad = [n for n, crc in meta.checksums.items()
               if n not in own or checksum(own[n]) != crc]
        if bad:
            raise ChecksumError(
                f"after applying the payload for version {meta.version}, {len(bad)} tensor(s) "
                f"differ from the trainer's: {bad[:3]}; the engine is marked version -1 and "
                f"needs a full sync")
