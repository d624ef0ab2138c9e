"""The numba kernels of rollwise.sync.coding: one compiled pass to find and code a tensor's
changes, one to apply them (see coding.py for the format)."""

import numpy as np
from numba import njit

from rollwise.sync.code_table import CODE_LARGE, CODE_MINUS, CODE_PLUS, CODE_SMALL, SHORT_GAP


@njit(cache=True, nogil=True)
def _scan(new, mirror, gap_bytes, codes, long_gaps, small, large, cap, mod, gap_size, width):
    half = mod // 2
    n = n_long = n_small = n_large = 0
    size, prev, byte, fits = 0, -1, 0, True
    for i in range(new.shape[0]):
        b, a = new[i], mirror[i]
        if a == b:
            continue
        mirror[i] = b
        n += 1
        if not fits:  # past the limit: only count (and update the mirror)
            continue
        gap = i - prev
        prev = i
        if gap < SHORT_GAP:
            gap_bytes[n - 1] = gap
        else:
            gap_bytes[n - 1] = 0
            long_gaps[n_long] = gap
            n_long += 1
            size += gap_size
        d = (np.int64(b) - np.int64(a)) % mod  # the difference modulo 2^bits, then signed
        if d >= half:
            d -= mod
        if d == 1:
            code = CODE_PLUS
        elif d == -1:
            code = CODE_MINUS
        elif -128 <= d < 128:
            code = CODE_SMALL
            small[n_small] = d
            n_small += 1
            size += 1
        else:
            code = CODE_LARGE
            large[n_large] = d
            n_large += 1
            size += width
        slot = (n - 1) & 3
        byte |= code << (2 * slot)
        size += 1 + (slot == 0)  # the gap byte, and a new code byte every fourth change
        if slot == 3:
            codes[(n - 1) >> 2] = byte
            byte = 0
        fits = size < cap
    if fits and n & 3:
        codes[(n - 1) >> 2] = byte
    return n, fits, n_long, n_small, n_large


@njit(cache=True, nogil=True)
def _apply(flat, gap_bytes, codes, long_gaps, small, large, n):
    # first pass: check everything, write nothing
    pos, n_long, n_small, n_large = -1, 0, 0, 0
    for k in range(n):
        gap = np.int64(gap_bytes[k])
        if gap == 0:
            if n_long >= long_gaps.shape[0]:
                return 2, k
            gap = np.int64(long_gaps[n_long])
            n_long += 1
            if gap <= 0:
                return 5, gap
        pos += gap
        if pos >= flat.shape[0]:
            return 1, pos
        code = (codes[k >> 2] >> (2 * (k & 3))) & 3
        if code == CODE_SMALL:
            n_small += 1
            if n_small > small.shape[0]:
                return 3, k
        elif code == CODE_LARGE:
            n_large += 1
            if n_large > large.shape[0]:
                return 4, k
    left = (long_gaps.shape[0] - n_long) + (small.shape[0] - n_small) + (large.shape[0] - n_large)
    if left:
        return 6, left
    # second pass: write (a store into the tensor's integer type wraps modulo 2^bits)
    pos, n_long, n_small, n_large = -1, 0, 0, 0
    for k in range(n):
        gap = np.int64(gap_bytes[k])
        if gap == 0:
            gap = np.int64(long_gaps[n_long])
            n_long += 1
        pos += gap
        code = (codes[k >> 2] >> (2 * (k & 3))) & 3
        if code == CODE_PLUS:
            d = np.int64(1)
        elif code == CODE_MINUS:
            d = np.int64(-1)
        elif code == CODE_SMALL:
            d = np.int64(small[n_small])
            n_small += 1
        else:
            d = np.int64(large[n_large])
            n_large += 1
        flat[pos] = flat[pos] + d
    return 0, 0
