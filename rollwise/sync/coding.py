"""Compact, exact coding of one tensor's changes for sparse weight sync (`sync.coding=delta`).

SparseRL-Sync ships each changed element as an (int32 index, new value) pair: 6 bytes per
change in bf16, so at the ~1.5 % density of an RL step at lr 1e-6 the payload is only ~20x
smaller than the whole model. Both halves of a pair are mostly redundant:

- Indices are ascending, so their gaps are small (mean 1/density). A gap below 256 takes one
  byte; a 0 byte says "the next long gap", stored whole after the short ones.
- The engine holds the old value (the payload names its base, and the receiver checks it), so
  a new value is the old one plus a difference of their integer views. An AdamW step at a low
  learning rate moves a bf16 weight by one unit in the last place, i.e. the bits by +-1: a
  2-bit code says "+1", "-1", "the next small difference" (one signed byte, a few units in the
  last place: higher learning rates) or "the next large one" (stored whole).

About 1.3 bytes per change in bf16 at lr 1e-6 instead of 6. Decoding is exact for any change: the
difference is taken modulo 2^bits, so a sign flip, a NaN or a fresh value all round-trip.

Both directions are single passes compiled with numba: finding the changes, coding them and
updating the sender's mirror is one read of the new and the mirror's bits (vectorised torch needs
a mask, its nonzero, three gathers and a dozen passes over the changes: 3x slower on a 0.5B
model), and applying a payload touches only the changed elements.

Blob layout (each section padded to 8 bytes so it can be viewed in place):
    [gap bytes: n][2-bit codes: ceil(n / 4)][long gaps: int32 or int64]
    [small differences: int8][large differences: the element's width]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Coded:
    """What the receiver needs besides the blob."""
    changes: int  # elements changed
    long_gaps: int  # gaps >= 256, stored whole
    small_diffs: int  # other differences in -128..127, one byte each
    large_diffs: int  # the rest, stored whole
    width: int  # bytes per element (1, 2 or 4)
    gap_dtype: str  # "int32" or "int64" (tensors past 2^31 elements)

    def sections(self) -> list[tuple[int, torch.dtype]]:
        """(count, dtype) of each section in blob order."""
        gap = torch.int32 if self.gap_dtype == "int32" else torch.int64
        return [(self.changes, torch.uint8), ((self.changes + 3) // 4, torch.uint8),
                (self.long_gaps, gap), (self.small_diffs, torch.int8),
                (self.large_diffs, _INT[self.width])]

    @property
    def nbytes(self) -> int:
        return sum(_pad8(n * dt.itemsize) for n, dt in self.sections())


def codable(element_size: int) -> bool:
    return element_size in _INT


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def scan(new_bits: torch.Tensor, mirror_bits: torch.Tensor, gap_dtype: torch.dtype,
         limit: int) -> tuple[int, tuple[torch.Tensor, Coded] | None]:
    """Code where `new_bits` differs from `mirror_bits` (flat integer views of one tensor, the
    trainer's and the engine's), and bring the mirror up to date. Returns (elements changed,
    (uint8 blob, header)), or (elements changed, None) where the blob would take `limit` bytes
    or more (the caller sends that tensor whole). gap_dtype: int64 past 2^31 elements."""
    width = mirror_bits.element_size()
    if not codable(width) or new_bits.dtype != mirror_bits.dtype:
        raise ValueError(f"delta coding needs two integer views of one 1-, 2- or 4-byte dtype, "
                         f"got {new_bits.dtype} and {mirror_bits.dtype}")
    new, mirror = _np(new_bits), _np(mirror_bits)
    gap_size = gap_dtype.itemsize
    worst = new.size * (2 + gap_size + width) + 64  # every element changed, long gap, large
    cap = max(min(int(limit), worst), 8)  # no section holds more entries than the blob bytes
    gap_bytes, codes = np.empty(cap, np.uint8), np.empty(cap // 4 + 1, np.uint8)
    long_gaps, small = np.empty(cap // 4 + 1, np.int64), np.empty(cap, np.int8)
    large = np.empty(cap // width + 1, np.int64)
    n, fits, n_long, n_small, n_large = _kernels()._scan(
        new, mirror, gap_bytes, codes, long_gaps, small, large, cap,
        1 << (8 * width), gap_size, width)
    if not fits:
        return n, None
    head = Coded(n, n_long, n_small, n_large, width, str(gap_dtype).removeprefix("torch."))
    if head.nbytes >= limit:  # the sections' padding tipped it over
        return n, None
    blob = np.zeros(head.nbytes, np.uint8)
    parts = (gap_bytes[:n], codes[:(n + 3) // 4], long_gaps[:n_long].astype(_NP[gap_dtype]),
             small[:n_small], large[:n_large].astype(_INT_NP[width]))
    at = 0
    for part in parts:
        raw = part.view(np.uint8)
        blob[at:at + raw.size] = raw
        at += _pad8(raw.size)
    return n, (torch.from_numpy(blob), head)


def apply(flat_bits: torch.Tensor, blob: torch.Tensor, head: Coded) -> None:
    """Add the coded differences to `flat_bits` (a tensor's flat integer view) in place. The
    whole blob is checked against its header and the tensor first, so a malformed one raises
    ValueError and leaves the tensor untouched."""
    if blob.numel() < head.nbytes:
        raise ValueError(f"coded blob holds {blob.numel()} bytes, its header says {head.nbytes}")
    if flat_bits.element_size() != head.width:
        raise ValueError(f"coded for {head.width}-byte elements, the tensor has "
                         f"{flat_bits.element_size()}-byte ones")
    raw, parts, at = _np(blob), [], 0
    for count, dtype in head.sections():
        size = count * dtype.itemsize
        parts.append(raw[at:at + size].view(_NP[dtype]))
        at += _pad8(size)
    status, where = _kernels()._apply(_np(flat_bits), *parts, head.changes)
    if status:
        raise ValueError(_ERRORS[status].format(where=where, numel=flat_bits.numel()))


_NP = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
       torch.int64: np.int64}
_INT_NP = {w: _NP[t] for w, t in _INT.items()}
_ERRORS = {
    1: "coded index {where} is past the tensor's {numel} elements",
    2: "coded blob's long gaps run out at change {where} (its header has too few)",
    3: "coded blob's small differences run out at change {where}",
    4: "coded blob's large differences run out at change {where}",
    5: "coded blob has a long gap of {where}: gaps must be positive",
    6: "coded blob has {where} sections' entries left over: its header does not match it",
}


def _np(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor (uint8 stays unsigned: numba wraps either
    way on store)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("delta coding runs on contiguous CPU tensors")
    return t.reshape(-1).numpy()


def _kernels():
    """The numba kernels (rollwise.sync._kernels), imported on first use: numba is only needed
    once a sparse payload is coded, and importing it early upsets vLLM's start-up (its kernel
    registry scans every loaded module, and llvmlite's ffi object breaks that scan)."""
    from rollwise.sync import _kernels
    return _kernels
