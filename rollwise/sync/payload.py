"""Weight-sync payloads: full (every tensor) and sparse (SparseRL-Sync: only the elements whose
stored value changed, as flat index + new value), packed into per-dtype buckets.

A payload is two parts. The bytes a transport moves: one flat uint8 arena holding, per bucket,
a values region and (sparse buckets) an indices region, each padded to a multiple of 256
elements, as SparseRL-Sync pads each bucket for one aligned collective. And a small picklable
`PayloadMeta`: names, shapes, offsets, the version it applies to, and a checksum of the result.

    meta = plan(items, kind="sparse", ...)        # layout: which tensor goes where
    arena = torch.empty(meta.nbytes, dtype=torch.uint8)
    for name, (values, indices) in entry_views(meta, arena).items(): ...   # fill / read
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from dataclasses import dataclass, field, replace

import torch

from rollwise.sync.coding import Coded
from rollwise.sync.context_coding import ContextCoded

PAD = 256
"""Buckets hold a multiple of this many elements, so every region starts 256-byte aligned."""
INT32_MAX = 2**31 - 1
"""Tensors with more elements than this get int64 indices (SparseRL-Sync uses int32)."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def to_wire(t: torch.Tensor) -> tuple[bytes, str, tuple[int, ...]]:
    """A tensor as plain bytes: pickling a tensor into a pipe would move the parent's storage
    into shared memory as a side effect."""
    t = t.detach().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy()), dtype_name(t.dtype), tuple(t.shape)


def from_wire(w) -> torch.Tensor:
    data, dtype, shape = w
    return torch.frombuffer(bytearray(data), dtype=to_dtype(dtype)).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor: equality is then bit for bit (NaN == NaN with the
    same payload, -0.0 != +0.0), which is what 'the engine holds the same weights' means."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype.is_complex:
        raise TypeError(f"complex tensors are not supported by weight sync ({t.dtype})")
    return t.view(_BITS[t.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= INT32_MAX else torch.int64


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (row-major). zlib is in the standard library and runs at
    ~1-2 GB/s on one core; it is computed on CPU tensors (a GPU transport moves it first)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy())


def digest(checksums: dict[str, int] | None, sender: str, version: int) -> str:
    """A name for a set of weights. With checksums it depends on the content only, so any
    sender holding the same weights builds payloads the engine accepts; without, it is the
    sender and the version."""
    if checksums is None:
        return f"{sender}@{version}"
    return hashlib.sha256(repr(sorted(checksums.items())).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * to_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Item:
    """One tensor to carry: whole (`indexed=False`, count = numel), as `count` changed
    elements with their flat indices, or as a delta-coded blob of `count` bytes (`coded`)."""

    name: str
    dtype: str
    count: int
    indexed: bool
    index_dtype: str | None = None
    coded: Coded | ContextCoded | None = None


@dataclass
class Entry:
    name: str
    bucket: int
    offset: int  # first element of this tensor in the bucket's values (and indices)
    count: int
    coded: Coded | ContextCoded | None = None  # a coded blob (sync.coding): count is bytes


@dataclass
class BucketMeta:
    dtype: str
    index_dtype: str | None  # None: a dense bucket (whole tensors, no indices)
    count: int  # elements used; the region holds `padded` elements
    padded: int
    values_at: int  # byte offsets in the arena
    indices_at: int | None
    coded: bool = False  # holds delta-coded blobs (uint8), one per entry

    @property
    def nbytes(self) -> int:
        n = self.padded * to_dtype(self.dtype).itemsize
        if self.index_dtype is not None:
            n += self.padded * to_dtype(self.index_dtype).itemsize
        return n


@dataclass
class PayloadMeta:
    kind: str  # "full" (every tensor, applies to any engine) | "sparse" (needs base_version)
    sender: str
    base_version: int | None
    version: int
    buckets: list[BucketMeta]
    entries: list[Entry]
    nbytes: int  # arena bytes
    changed: int = 0  # elements whose value changed (sparse); total for full payloads
    total: int = 0  # elements in the model
    dense_tensors: int = 0  # tensors of a sparse payload sent whole (denser than break-even)
    checksums: dict[str, int] | None = None  # CRC-32 per tensor of the engine's result
    digest: str = ""  # names the result's weights (see `digest`)
    base_digest: str | None = None  # names the weights a sparse payload applies to
    seconds: dict[str, float] = field(default_factory=dict)  # sender-side timings


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def plan(items: list[Item], *, kind: str, sender: str, base_version: int | None, version: int,
         bucket_bytes: int) -> PayloadMeta:
    """Lay the items out in buckets: one kind of bucket per (dtype, index dtype); a bucket is
    closed when adding a tensor would take it past `bucket_bytes` (a larger tensor goes alone)."""
    groups: dict[tuple[str, str | None], list[Item]] = {}
    for it in items:
        if it.count == 0:
            continue  # SparseRL-Sync drops tensors with nothing changed
        key = ("coded", None) if it.coded else (it.dtype, it.index_dtype if it.indexed else None)
        groups.setdefault(key, []).append(it)
    buckets: list[BucketMeta] = []
    entries: list[Entry] = []
    at = 0
    for (dtype, idx_dtype), group in groups.items():
        coded = dtype == "coded"
        dtype = "uint8" if coded else dtype  # coded blobs are bytes
        per_elem = to_dtype(dtype).itemsize + (to_dtype(idx_dtype).itemsize if idx_dtype else 0)
        start = 0
        while start < len(group):
            count, end = 0, start
            while end < len(group) and (end == start or
                                        (count + group[end].count) * per_elem <= bucket_bytes):
                it = group[end]
                entries.append(Entry(it.name, len(buckets), count, it.count, it.coded))
                count += it.count
                end += 1
            padded = _round_up(count, PAD)
            values_at = at
            at += padded * to_dtype(dtype).itemsize
            indices_at = None
            if idx_dtype is not None:
                indices_at = at
                at += padded * to_dtype(idx_dtype).itemsize
            buckets.append(BucketMeta(dtype, idx_dtype, count, padded, values_at, indices_at,
                                      coded))
            start = end
    return PayloadMeta(kind, sender, base_version, version, buckets, entries, at)


def _region(arena: torch.Tensor, at: int, count: int, dtype: str) -> torch.Tensor:
    dt = to_dtype(dtype)
    return arena[at:at + count * dt.itemsize].view(dt)


def bucket_views(meta: PayloadMeta, arena: torch.Tensor):
    """[(values, indices or None)] per bucket, padded regions included (what a collective
    sends); views into the arena, no copies."""
    if arena.numel() < meta.nbytes:
        raise ValueError(f"payload arena holds {arena.numel()} bytes, the layout needs "
                         f"{meta.nbytes}")
    out = []
    for b in meta.buckets:
        values = _region(arena, b.values_at, b.padded, b.dtype)
        indices = None if b.index_dtype is None else _region(arena, b.indices_at, b.padded,
                                                             b.index_dtype)
        out.append((values, indices))
    return out


def entry_views(meta: PayloadMeta, arena: torch.Tensor):
    """{name: (values, indices or None)}: each tensor's slice of its bucket."""
    buckets = bucket_views(meta, arena)
    out = {}
    for e in meta.entries:
        values, indices = buckets[e.bucket]
        sl = slice(e.offset, e.offset + e.count)
        out[e.name] = (values[sl], None if indices is None else indices[sl])
    return out


def pack_meta(meta: PayloadMeta) -> bytes:
    """The metadata as it crosses a process boundary: pickled, then compressed (tensor names
    repeat their prefixes; at RL densities the metadata is ~15 % of a small model's payload).
    The random sender id and the digests travel beside the compressed part, so the byte count
    depends on the weights alone and a rerun with the same seed counts the same bytes; the
    sender's timings stay behind (the receiver has no use for them)."""
    names = (meta.sender, meta.digest, meta.base_digest)
    rest = replace(meta, sender="", digest="", base_digest=None, seconds={})
    return pickle.dumps((names, zlib.compress(pickle.dumps(rest), 1)))


def unpack_meta(data: bytes) -> PayloadMeta:
    (sender, digest, base_digest), body = pickle.loads(data)
    meta = pickle.loads(zlib.decompress(body))
    if not isinstance(meta, PayloadMeta):
        raise TypeError(f"expected payload metadata, got {type(meta).__name__}")
    return replace(meta, sender=sender, digest=digest, base_digest=base_digest)


def sparse_wins(count: int, numel: int, value_size: int, idx_size: int) -> bool:
    """(index, value) pairs are smaller than the whole tensor: below ~1/3 density for bf16
    with int32 indices, 1/2 for fp32 (SparseRL-Sync's break-even)."""
    return count * (value_size + idx_size) < numel * value_size


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage: tied weights (a tied `lm_head.weight` and
    `model.embed_tokens.weight`) are listed by state_dict under each name but sent once, under
    the first name."""
    seen: set[tuple] = set()
    out = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
