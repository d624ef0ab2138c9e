"""Context coding of one tensor's changes for sparse weight sync (`sync.coding=context`).

Whether an element changes in an RL step at a low learning rate depends mostly on its size:
a step of about lr moves the stored value only when lr is comparable with the value's unit in
the last place, and that unit doubles with every exponent. The engine holds the old value, so
both sides know each element's exponent. Grouping elements by it (the 8 bits after the sign:
bf16's and fp32's exponent, fp16's exponent and three mantissa bits) makes each group's changes
close to uniform, and their gaps and sizes are coded with one Rice parameter per group: at lr
1e-6 in bf16 a change's position costs about 2-3 bits instead of the ~8 of one shared gap code
(rollwise.sync.coding).

Per group with changes: the gaps between changed members (counted among that group's members:
gap - 1 >= 0) and the differences of their integer views (modulo 2^bits, signed; zigzag minus
one: +1 -> 0, -1 -> 1, +2 -> 2, -2 -> 3, ...) as Rice codes, interleaved gap, difference, gap,
... in one bit stream. A group whose differences are all +-1 spends one bit on each. A Rice
quotient of ESCAPE or more is written as ESCAPE ones and the value in 64 plain bits, so any
change round-trips (a sign flip, a NaN, a fresh value).

Blob: [group table: GROUP_FIELDS uint32 per group with changes: group, changes, k | j << 8,
stream bytes][the groups' streams, each whole bytes, in table order]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ESCAPE = 24  # a Rice quotient this large is written as ESCAPE ones and 64 plain bits
SIGN_ONLY = 255  # a group's difference parameter when every difference is +-1
GROUP_FIELDS = 4
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class ContextCoded:
    """What the receiver needs besides the blob."""
    changes: int
    groups: int  # groups with changes (rows of the blob's table)
    width: int  # bytes per element (1, 2 or 4)
    nbytes: int  # the blob's size


def group_bits(width: int) -> tuple[int, int]:
    """(mask, shift): an element's group is (bits & mask) >> shift, the 8 bits after the sign
    (7 for 1-byte elements)."""
    total = 8 * width
    return (1 << (total - 1)) - 1, max(0, total - 9)


def scan(new_bits: torch.Tensor, mirror_bits: torch.Tensor, limit: int
         ) -> tuple[int, tuple[torch.Tensor, ContextCoded] | None]:
    """Code where `new_bits` differs from `mirror_bits` (flat integer views of one tensor, the
    trainer's and the engine's) and bring the mirror up to date. Returns (elements changed,
    (uint8 blob, header)), or (elements changed, None) where the blob would take `limit` bytes
    or more (the caller sends that tensor whole)."""
    width = mirror_bits.element_size()
    if width not in _INT or new_bits.dtype != mirror_bits.dtype:
        raise ValueError(f"context coding needs two integer views of one 1-, 2- or 4-byte "
                         f"dtype, got {new_bits.dtype} and {mirror_bits.dtype}")
    new, mirror = _np(new_bits), _np(mirror_bits)
    mask, shift = group_bits(width)
    k = _kernels()
    cap = new.size // 32 + 1024  # changes recorded on the first pass; a denser tensor rescans
    while True:
        index, rank, diff = (np.empty(cap, np.int64) for _ in range(3))
        group, members = np.empty(cap, np.uint8), np.zeros(256, np.int64)
        n = k.ctx_find(new, mirror, mask, shift, 1 << (8 * width), index, rank, group, diff,
                       members)
        if n <= cap:
            break
        cap = n
    mirror[index[:n]] = new[index[:n]]
    if n == 0:
        return 0, None
    out = np.zeros(min(int(limit), n * 23 + 4096 + 320), np.uint8)  # 22: escaped gap and diff
    size, groups = k.ctx_encode(rank[:n], group[:n], diff[:n], members, out, ESCAPE, SIGN_ONLY,
                                GROUP_FIELDS)
    if size < 0 or size >= limit:
        return n, None
    return n, (torch.from_numpy(out[:size].copy()), ContextCoded(n, groups, width, size))


def apply(flat_bits: torch.Tensor, blob: torch.Tensor, head: ContextCoded) -> None:
    """Add the coded differences to `flat_bits` (a tensor's flat integer view) in place. The
    blob is decoded whole against the tensor first, so a malformed one raises ValueError and
    leaves the tensor untouched."""
    if blob.numel() < head.nbytes:
        raise ValueError(f"context-coded blob holds {blob.numel()} bytes, its header says "
                         f"{head.nbytes}")
    if flat_bits.element_size() != head.width:
        raise ValueError(f"context-coded for {head.width}-byte elements, the tensor has "
                         f"{flat_bits.element_size()}-byte ones")
    flat = _np(flat_bits)
    mask, shift = group_bits(head.width)
    index, value = np.empty(head.changes, np.int64), np.empty(head.changes, flat.dtype)
    status, where = _kernels().ctx_decode(flat, _np(blob)[:head.nbytes], head.groups,
                                          head.changes, mask, shift, 1 << (8 * head.width),
                                          ESCAPE, SIGN_ONLY, GROUP_FIELDS, index, value)
    if status:
        raise ValueError(_ERRORS[status].format(where=where, numel=flat.size))
    flat[index] = value


_ERRORS = {
    1: "context-coded blob's group table runs past the blob (group row {where})",
    2: "context-coded blob's group {where} is named twice or is not a group",
    3: "context-coded blob's stream of group {where} runs out",
    4: "context-coded blob names {where} more changes than the tensor's groups reach",
    5: "context-coded blob's header counts differ from its table ({where})",
}


def _np(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("context coding runs on contiguous CPU tensors")
    return t.reshape(-1).numpy()


def _kernels():
    """Imported on first use, as rollwise.sync.coding's (numba upsets vLLM's start-up)."""
    from rollwise.sync import _context_kernels
    return _context_kernels
