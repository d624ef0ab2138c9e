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

Blob layout (each section padded to 8 bytes so it can be viewed in place):
    [gap bytes: n][2-bit codes: ceil(n / 4)][long gaps: int32 or int64]
    [small differences: int8][large differences: the element's width]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHORT_GAP = 256  # gaps 1..255 fit a byte; 0 marks a long one
CODE_PLUS, CODE_MINUS, CODE_SMALL, CODE_LARGE = 0, 1, 2, 3
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


def _wrap(x: torch.Tensor, width: int) -> torch.Tensor:
    """x modulo 2^(8*width), as a signed value of that width (two's complement)."""
    half = 1 << (8 * width - 1)
    return ((x + half) & ((1 << (8 * width)) - 1)) - half


def _signed(bits: torch.Tensor) -> torch.Tensor:
    """Integer view -> the same two's-complement value in a type wide enough for sums of two
    (int32 for 1- and 2-byte elements, int64 for 4); uint8 views read as signed."""
    if bits.dtype == torch.uint8:
        bits = bits.view(torch.int8)
    return bits.to(torch.int32 if bits.element_size() <= 2 else torch.int64)


def encode(idx: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor,
           gap_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, Coded]:
    """idx: ascending int64 flat indices of the changed elements; old_bits/new_bits: the
    integer views of their engine-held and new values; gap_dtype: int64 for tensors past 2^31
    elements. Returns (uint8 blob, header)."""
    width = old_bits.element_size()
    if not codable(width):
        raise ValueError(f"delta coding supports 1-, 2- and 4-byte elements, not {width}")
    n = idx.numel()
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    short = gaps < SHORT_GAP
    gap_bytes = torch.where(short, gaps, 0).to(torch.uint8)
    long_gaps = gaps[~short].to(gap_dtype)
    diff = _wrap(_signed(new_bits) - _signed(old_bits), width)
    size = diff.abs()
    codes = torch.where(size == 1, (diff < 0).to(torch.uint8),
                        (size >= 128).to(torch.uint8) + CODE_SMALL)
    small_diffs = diff[codes == CODE_SMALL].to(torch.int8)
    large_diffs = diff[codes == CODE_LARGE].to(_INT[width])
    four = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8)
    four[:n] = codes
    four = four.view(-1, 4)
    packed = four[:, 0] | (four[:, 1] << 2) | (four[:, 2] << 4) | (four[:, 3] << 6)
    head = Coded(n, long_gaps.numel(), small_diffs.numel(), large_diffs.numel(), width,
                 str(gap_dtype).removeprefix("torch."))
    blob = torch.zeros(head.nbytes, dtype=torch.uint8)
    at = 0
    for part in (gap_bytes, packed, long_gaps, small_diffs, large_diffs):
        raw = part.reshape(-1).view(torch.uint8)
        blob[at:at + raw.numel()] = raw
        at += _pad8(raw.numel())
    return blob, head


def decode(blob: torch.Tensor, head: Coded) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ascending int64 indices, differences modulo 2^bits as in `_signed`'s type)."""
    if blob.numel() < head.nbytes:
        raise ValueError(f"coded blob holds {blob.numel()} bytes, its header says {head.nbytes}")
    parts, at = [], 0
    for count, dtype in head.sections():
        raw = blob[at:at + count * dtype.itemsize]
        parts.append(raw.view(dtype) if count else torch.empty(0, dtype=dtype, device=blob.device))
        at += _pad8(count * dtype.itemsize)
    gap_bytes, packed, long_gaps, small_diffs, large_diffs = parts
    gaps = gap_bytes.to(torch.int64)
    escaped = gaps == 0
    if int(escaped.sum()) != head.long_gaps:
        raise ValueError(f"coded blob has {int(escaped.sum())} long-gap marks, its header says "
                         f"{head.long_gaps}")
    gaps[escaped] = long_gaps.to(torch.int64)
    idx = gaps.cumsum(0) - 1
    codes = torch.stack([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6],
                        1).reshape(-1)[: head.changes]
    diff = 1 - 2 * codes.to(torch.int32 if head.width <= 2 else torch.int64)  # +1 / -1 codes
    for code, values in ((CODE_SMALL, small_diffs), (CODE_LARGE, large_diffs)):
        where = codes == code
        if int(where.sum()) != values.numel():
            raise ValueError(f"coded blob has {int(where.sum())} differences of code {code}, "
                             f"its header says {values.numel()}")
        diff[where] = values.to(diff.dtype)
    return idx, diff


def apply(flat_bits: torch.Tensor, idx: torch.Tensor, diff: torch.Tensor) -> None:
    """flat_bits[idx] += diff, modulo 2^bits, in place (flat_bits: a tensor's integer view)."""
    if idx.numel() and int(idx[-1]) >= flat_bits.numel():
        raise ValueError(f"coded index {int(idx[-1])} is past the tensor's "
                         f"{flat_bits.numel()} elements")
    width = flat_bits.element_size()
    new = _wrap(_signed(flat_bits.index_select(0, idx)) + diff, width)
    if flat_bits.dtype == torch.uint8:
        new = new & 0xFF
    flat_bits.index_copy_(0, idx, new.to(flat_bits.dtype))
