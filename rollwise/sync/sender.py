"""Trainer side of weight sync: the trainer's weights -> a full or sparse payload for one engine.

SparseRL-Sync (docs/methods.md#sparse-sync) finds the changed elements by comparing the bf16 weights
before and after each optimizer step and uniting the index sets over the steps since the last
sync. Here the sender keeps `mirror`, a copy of exactly what the engine holds, in the engine's
dtypes, and compares the trainer's weights (cast to those dtypes) with it bit for bit. That is
the same union over the steps since the last sync, minus elements that changed and changed
back (the engine already holds them), and it needs no hook in the optimizer. Cost: one copy
of the weights in the engine's dtype, as SparseRL-Sync's before-snapshot.

The receiver replaces values (never adds deltas), so nothing accumulates: a payload is exact
whenever the engine held the mirror's weights, which the version and the checksum prove.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from rollwise.sync import coding, context_coding
from rollwise.sync.payload import (
    Item,
    PayloadMeta,
    TensorSpec,
    bits,
    checksum,
    digest,
    dtype_name,
    entry_views,
    index_dtype,
    plan,
    sparse_wins,
    to_dtype,
)

Alloc = Callable[[int], torch.Tensor]  # nbytes -> a uint8 arena the transport can move


class Sender:
    def __init__(self, spec: dict[str, TensorSpec], *, keep_mirror: bool, with_checksum: bool,
                 bucket_bytes: int, coding: str = "context"):
        if coding not in ("delta", "context", "pairs"):
            raise ValueError(f"sync coding {coding!r}: use 'delta', 'context' or 'pairs'")
        self.coding = coding
        self.id = uuid.uuid4().hex[:12]
        self.spec = spec
        self.keep_mirror = keep_mirror  # sparse payloads need it; full-only syncs do not
        self.with_checksum = with_checksum
        self.bucket_bytes = bucket_bytes
        self.mirror: dict[str, torch.Tensor] = {}
        self.version: int | None = None  # the version the mirror holds; None: unknown
        self.digest: str | None = None  # names the weights the mirror holds
        self.total = sum(s.numel for s in spec.values())
        self.full_bytes = sum(s.nbytes for s in spec.values())
        self._crc: dict[str, int] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._mask = torch.empty(0, dtype=torch.bool)

    @property
    def ready(self) -> bool:
        """True when the mirror holds what the engine holds, so a sparse payload can be built."""
        return self.keep_mirror and self.version is not None

    def reset(self) -> None:
        """Forget what the engine holds (a refused or failed payload): the next one is full."""
        self.version = self.digest = None

    def encode(self, weights: dict[str, torch.Tensor], version: int, alloc: Alloc,
               full: bool) -> tuple[PayloadMeta, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            meta, arena, dirty = (self._full(weights, version, alloc) if full or not self.ready
                                  else self._sparse(weights, version, alloc))
        t1 = time.perf_counter()
        if self.with_checksum:
            for name, t in dirty.items():
                self._crc[name] = checksum(t)
            meta.checksums = {n: self._crc.get(n, 0) for n in self.spec}
        meta.digest = digest(meta.checksums, self.id, version)
        meta.total = self.total
        meta.seconds = {"encode": t1 - t0, "checksum": time.perf_counter() - t1}
        self.version = version if self.keep_mirror else None
        self.digest = meta.digest if self.keep_mirror else None
        return meta, arena

    def _weight(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        w = weights.get(name)
        if w is None:
            raise KeyError(f"the trainer has no weight {name!r}, which the engine holds")
        if tuple(w.shape) != self.spec[name].shape:
            raise ValueError(f"weight {name!r}: trainer shape {tuple(w.shape)}, engine shape "
                             f"{self.spec[name].shape}")
        return w.detach().reshape(-1)

    def _full(self, weights, version: int, alloc: Alloc):
        items = [Item(n, s.dtype, s.numel, False) for n, s in self.spec.items()]
        meta = plan(items, kind="full", sender=self.id, base_version=None, version=version,
                    bucket_bytes=self.bucket_bytes)
        arena = alloc(meta.nbytes)
        views = entry_views(meta, arena)
        dirty = {}
        for name, s in self.spec.items():
            w = self._weight(weights, name)
            if name not in views:  # an empty tensor
                continue
            values = dirty[name] = views[name][0]
            values.copy_(w)  # casts to the engine's dtype on the way
            if self.keep_mirror:
                if name not in self.mirror:
                    self.mirror[name] = torch.empty(s.numel, dtype=to_dtype(s.dtype))
                self.mirror[name].copy_(values)
        meta.changed = self.total
        return meta, arena, dirty

    def _sparse(self, weights, version: int, alloc: Alloc):
        items, parts, changed, dirty = [], {}, 0, {}
        for name, s in self.spec.items():
            mirror = self.mirror[name]
            new = self._as_engine_dtype(self._weight(weights, name), mirror.dtype)
            idt = index_dtype(s.numel)
            nbytes = mirror.numel() * mirror.element_size()
            if self.coding != "pairs" and coding.codable(mirror.element_size()):
                n, coded = (coding.scan(bits(new), bits(mirror), idt, limit=nbytes)  # mirror too
                            if self.coding == "delta" else
                            context_coding.scan(bits(new), bits(mirror), limit=nbytes))
                if coded is not None:
                    parts[name] = coded[0]
                    items.append(Item(name, s.dtype, coded[0].numel(), False, coded=coded[1]))
            else:
                idx, new_bits = self._changed(new, mirror)
                n = idx.numel()
                if n and sparse_wins(n, s.numel, mirror.element_size(), idt.itemsize):
                    parts[name] = (idx.to(idt), new_bits.view(mirror.dtype))
                    items.append(Item(name, s.dtype, n, True, dtype_name(idt)))
                bits(mirror).index_copy_(0, idx, new_bits)
            if n == 0:
                continue
            changed += n
            dirty[name] = mirror
            if name not in parts:  # denser than break-even: this tensor goes whole
                parts[name] = None
                items.append(Item(name, s.dtype, s.numel, False))
        meta = plan(items, kind="sparse", sender=self.id, base_version=self.version,
                    version=version, bucket_bytes=self.bucket_bytes)
        meta.base_digest = self.digest
        arena = alloc(meta.nbytes)
        for name, (values, indices) in entry_views(meta, arena).items():
            if parts[name] is None:
                values.copy_(self.mirror[name])
            elif isinstance(parts[name], torch.Tensor):  # a coded blob
                values.copy_(parts[name])
            else:
                indices.copy_(parts[name][0])
                values.copy_(parts[name][1])
        meta.changed = changed
        meta.dense_tensors = sum(p is None for p in parts.values())
        return meta, arena, dirty

    def _as_engine_dtype(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The trainer's weight in the engine's dtype, cast into a reused buffer (a fresh
        allocation per tensor costs more than the cast itself on CPU)."""
        if w.dtype == dtype:
            return w
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < w.numel():
            buf = self._scratch[dtype] = torch.empty(w.numel(), dtype=dtype)
        return buf[:w.numel()].copy_(w)

    def _changed(self, new: torch.Tensor, mirror: torch.Tensor):
        """(flat int64 indices, ascending, where the stored bits differ; the new bits there).
        Compared 8 bytes at a time first (4 bf16 per word): at RL densities most words are
        equal, so the element-wise work runs only on the few words that differ (2-3x faster on
        CPU at ~1% density), and the bits come from those words."""
        per = 8 // new.element_size()
        if per > 1 and new.numel() % per == 0:
            try:
                a, b = new.view(torch.int64), mirror.view(torch.int64)
            except RuntimeError:  # storage offset not 8-byte aligned
                pass
            else:
                words = flatnonzero(self._ne(a, b))
                if words.numel() * 4 <= a.numel():  # else element-wise is cheaper
                    kind = bits(new).dtype
                    aw = a.index_select(0, words)
                    bw = b.index_select(0, words)
                    hit = flatnonzero(aw.view(kind) != bw.view(kind))  # the differing elements
                    shift = per.bit_length() - 1
                    idx = (words.index_select(0, hit >> shift) << shift) | (hit & (per - 1))
                    return idx, aw.view(kind).index_select(0, hit)
        a, b = bits(new), bits(mirror)
        idx = flatnonzero(self._ne(a, b))
        return idx, a.index_select(0, idx)

    def _ne(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self._mask.numel() < a.numel():
            self._mask = torch.empty(a.numel(), dtype=torch.bool)
        return torch.ne(a, b, out=self._mask[:a.numel()])


def flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 positions of the True elements of a 1-D mask; numpy's is ~4x faster on CPU."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)
