"""The numba kernels of rollwise.sync.context_coding (see there for the format): one pass to
find a tensor's changes with each one's group and rank among its group's members, one to code
them group by group, one to decode a blob against the tensor's old values."""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def ctx_find(new, mirror, mask, shift, mod, index, rank, group, diff, members):
    """Records the first len(index) changes; returns how many there are."""
    half, cap, n = mod // 2, index.shape[0], 0
    for i in range(new.shape[0]):
        a = np.int64(mirror[i])
        g = (a & mask) >> shift
        b = np.int64(new[i])
        if a != b:
            if n < cap:
                d = (b - a) % mod
                if d >= half:
                    d -= mod
                index[n], rank[n], group[n], diff[n] = i, members[g], g, d
            n += 1
        members[g] += 1
    return n


@njit(cache=True, nogil=True)
def _rice_param(total, count):
    """floor(log2(mean)), 0 below a mean of 2: near the best Rice parameter for a geometric
    source of that mean."""
    k = 0
    while k < 62 and (count << (k + 1)) <= total:
        k += 1
    return k


@njit(cache=True, nogil=True)
def _put(out, pos, value, nbits, cap_bits):
    """Writes the low nbits of value, most significant first, a byte's room at a time."""
    if pos < 0 or pos + nbits > cap_bits:
        return -1
    while nbits > 0:
        room = 8 - (pos & 7)
        take = min(room, nbits)
        chunk = (value >> (nbits - take)) & ((1 << take) - 1)
        out[pos >> 3] |= np.uint8(chunk << (room - take))
        pos += take
        nbits -= take
    return pos


@njit(cache=True, nogil=True)
def _put_rice(out, pos, v, k, escape, cap_bits):
    q = v >> k
    if q >= escape:
        pos = _put(out, pos, (1 << escape) - 1, escape, cap_bits)
        return _put(out, pos, v, 64, cap_bits)
    pos = _put(out, pos, ((1 << q) - 1) << 1, q + 1, cap_bits)  # q ones, a zero
    return _put(out, pos, v, k, cap_bits)


@njit(cache=True, nogil=True)
def _put_u32(out, at, x):
    for b in range(4):
        out[at + b] = np.uint8((x >> (8 * b)) & 0xFF)


@njit(cache=True, nogil=True)
def ctx_encode(rank, group, diff, members, out, escape, sign_only, fields):
    """Writes the table and the streams into `out` (zeroed); returns (bytes, groups), or
    (-1, 0) where `out` is too small."""
    n = rank.shape[0]
    counts = np.zeros(257, np.int64)
    for t in range(n):
        counts[group[t] + 1] += 1
    n_groups = 0
    for g in range(256):
        n_groups += 1 if counts[g + 1] > 0 else 0
        counts[g + 1] += counts[g]  # counts[g]: where group g starts in `order`
    order, fill = np.empty(n, np.int64), counts[:256].copy()
    for t in range(n):
        order[fill[group[t]]] = t
        fill[group[t]] += 1
    cap_bits = out.shape[0] * 8
    pos = n_groups * fields * 4 * 8
    if pos > cap_bits:
        return -1, 0
    row = 0
    for g in range(256):
        lo, hi = counts[g], counts[g + 1]
        c = hi - lo
        if c == 0:
            continue
        last = rank[order[hi - 1]]
        k = _rice_param(last + 1 - c, c)  # the sum of (gap - 1) over the group
        zsum, pm1 = 0, True
        for s in range(lo, hi):
            d = diff[order[s]]
            zsum += 2 * (abs(d) - 1) + (d < 0)
            pm1 = pm1 and (d == 1 or d == -1)
        j = sign_only if pm1 else _rice_param(zsum, c)
        start, prev = pos, -1
        for s in range(lo, hi):
            t = order[s]
            pos = _put_rice(out, pos, rank[t] - prev - 1, k, escape, cap_bits)
            prev = rank[t]
            d = diff[t]
            if j == sign_only:
                pos = _put(out, pos, np.int64(d < 0), 1, cap_bits)
            else:
                pos = _put_rice(out, pos, 2 * (abs(d) - 1) + (d < 0), j, escape, cap_bits)
            if pos < 0:
                return -1, 0
        pos = (pos + 7) // 8 * 8
        at = row * fields * 4
        _put_u32(out, at, g)
        _put_u32(out, at + 4, c)
        _put_u32(out, at + 8, k | (j << 8))
        _put_u32(out, at + 12, (pos - start) // 8)
        row += 1
    return pos // 8, n_groups


@njit(cache=True, nogil=True)
def _get(blob, pos, end, nbits):
    """(value, new position); position -1 past `end`."""
    if pos < 0 or pos + nbits > end:
        return 0, -1
    v = 0
    while nbits > 0:
        room = 8 - (pos & 7)
        take = min(room, nbits)
        v = (v << take) | ((np.int64(blob[pos >> 3]) >> (room - take)) & ((1 << take) - 1))
        pos += take
        nbits -= take
    return v, pos


@njit(cache=True, nogil=True)
def _get_rice(blob, pos, end, k, escape):
    q = 0
    while q < escape:
        bit, pos = _get(blob, pos, end, 1)
        if pos < 0:
            return 0, -1
        if bit == 0:
            break
        q += 1
    if q == escape:
        return _get(blob, pos, end, 64)
    r, pos = _get(blob, pos, end, k)
    return (q << k) | r, pos


@njit(cache=True, nogil=True)
def _get_u32(blob, at):
    x = 0
    for b in range(4):
        x |= np.int64(blob[at + b]) << (8 * b)
    return x


@njit(cache=True, nogil=True)
def ctx_decode(flat, blob, n_groups, n_changes, mask, shift, mod, escape, sign_only, fields,
               index, value):
    """Fills index and value (the new integer views) without touching `flat`; returns
    (status, where): 0 when the blob decoded whole, else the error's code."""
    half = mod // 2
    cursor, end = np.full(256, -1, np.int64), np.zeros(256, np.int64)
    left, kk, jj = np.zeros(256, np.int64), np.zeros(256, np.int64), np.zeros(256, np.int64)
    nxt, pos = np.full(256, -1, np.int64), np.zeros(256, np.int64)
    at, total = n_groups * fields * 4, 0
    if at > blob.shape[0]:
        return 1, 0
    for r in range(n_groups):
        row = r * fields * 4
        g, c = _get_u32(blob, row), _get_u32(blob, row + 4)
        kj, size = _get_u32(blob, row + 8), _get_u32(blob, row + 12)
        if g > 255 or cursor[g] != -1:
            return 2, g
        if at + size > blob.shape[0]:
            return 1, r
        kk[g], jj[g], left[g] = kj & 0xFF, (kj >> 8) & 0xFF, c
        cursor[g], end[g] = at * 8, (at + size) * 8
        at += size
        total += c
    if total != n_changes:
        return 5, total
    for g in range(256):
        if left[g] > 0:
            v, cursor[g] = _get_rice(blob, cursor[g], end[g], kk[g], escape)
            if cursor[g] < 0 or v < 0:
                return 3, g
            nxt[g] = v
    out = 0
    for i in range(flat.shape[0]):
        a = np.int64(flat[i])
        g = (a & mask) >> shift
        if pos[g] == nxt[g]:  # -1 once a group has no changes left
            if jj[g] == sign_only:
                bit, cursor[g] = _get(blob, cursor[g], end[g], 1)
                d = -1 if bit else 1
            else:
                z, cursor[g] = _get_rice(blob, cursor[g], end[g], jj[g], escape)
                d = z // 2 + 1
                if z & 1:
                    d = -d
            if cursor[g] < 0:
                return 3, g
            v = (a + d) % mod
            if v >= half:
                v -= mod
            index[out], value[out] = i, v
            out += 1
            left[g] -= 1
            nxt[g] = -1
            if left[g] > 0:
                gap, cursor[g] = _get_rice(blob, cursor[g], end[g], kk[g], escape)
                if cursor[g] < 0 or gap < 0:
                    return 3, g
                nxt[g] = pos[g] + 1 + gap
        pos[g] += 1
    if out != n_changes:
        return 4, n_changes - out
    return 0, 0
