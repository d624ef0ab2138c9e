"""The built-in engine's prefix cache index: which token prefixes have K/V kept, no torch.

A sequence that finishes leaves its K/V (prompt + the tokens it fed) as an entry; a later request
whose ids start with an entry's reuses those positions and prefills only the rest (an agent's
next turn is its episode so far + the environment's tokens; a TRACE continuation is a root's
prefix). Entries are found through chained hashes of 16-token blocks, as vLLM's prefix cache
does, then checked id for id, so a hash collision can cost a lookup but never reuse wrong K/V.
The index keeps at most `budget` positions, dropping the least recently used entries; the runner
holds the tensors by entry id (Runner.save / load / drop).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK = 16  # a request reuses an entry when they share at least one whole block


def block_hashes(ids: list[int]) -> list[int]:
    """h[i]: the hash of ids[:(i + 1) * BLOCK], chained block by block."""
    out, h = [], 0
    for end in range(BLOCK, len(ids) + 1, BLOCK):
        h = hash((h, tuple(ids[end - BLOCK:end])))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, budget: int):
        if budget < BLOCK:
            raise ValueError(f"prefix cache budget {budget} positions: give at least {BLOCK} "
                             f"(one block), or 0 to turn the cache off")
        self.budget = budget
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # id -> its ids; LRU first
        self._by_hash: dict[int, set[int]] = {}
        self._hashes: dict[int, list[int]] = {}
        self._next = 0
        self.size = 0  # positions held

    def lookup(self, ids: list[int]) -> tuple[int, int] | None:
        """(entry id, positions to reuse) for the entry sharing the longest prefix with `ids`,
        at most len(ids) - 1 (the last token is fed to get the next token's logits)."""
        deepest = _deepest(self._by_hash, ids)
        best, best_n = None, 0
        for e in sorted(deepest):  # ties go to the oldest entry, whatever the ids' offset: a
            # round picks the same K/V whatever earlier rounds (an evaluation) entered
            n = _common(self.entries[e], ids, len(ids) - 1)
            if n > best_n:
                best, best_n = e, n
        if best is None or best_n < BLOCK:
            return None
        self.entries.move_to_end(best)
        return best, best_n

    def insert(self, ids: list[int]) -> tuple[int | None, list[int]]:
        """Keep `ids` (its K/V to be saved under the returned id); returns (id, the ids of
        entries dropped to make room). Too short or too long an entry is not kept (id None)."""
        if not BLOCK <= len(ids) <= self.budget:
            return None, []
        dropped = []
        while self.size + len(ids) > self.budget:
            oldest = next(iter(self.entries))
            self.remove(oldest)
            dropped.append(oldest)
        e, self._next = self._next, self._next + 1
        self.entries[e] = list(ids)
        self._hashes[e] = block_hashes(ids)
        for h in self._hashes[e]:
            self._by_hash.setdefault(h, set()).add(e)
        self.size += len(ids)
        return e, dropped

    def remove(self, e: int) -> None:
        ids = self.entries.pop(e)
        for h in self._hashes.pop(e):
            bucket = self._by_hash[h]
            bucket.discard(e)
            if not bucket:
                del self._by_hash[h]
        self.size -= len(ids)

    def clear(self) -> list[int]:
        """Forget every entry; returns their ids (for the runner to drop)."""
        gone = list(self.entries)
        self.entries.clear(), self._by_hash.clear(), self._hashes.clear()
        self.size = 0
        return gone


def _deepest(by_hash: dict, ids: list[int]):
    """The bucket of the deepest block of ids[:-1] (the last token is always fed) found in
    `by_hash`: its members share the most with `ids` (empty if none shares a block)."""
    deepest: Any = ()
    for h in block_hashes(ids[:-1]):
        found = by_hash.get(h)
        if not found:
            break
        deepest = found
    return deepest


def _common(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class LivePrefixes:
    """Running sequences as donors of K/V (`share_prefix`): a request admitted later whose ids
    start with the same block(s) as a running sequence's copies those positions from its slot
    and prefills only the rest, as vLLM's prefix caching shares the blocks of live requests.
    APRIL's resumed answers are the case: each is its prompt + partial answer, and a group's
    members share the prompt. Donors are found by the same chained block hashes, then checked
    id for id. Only K/V of the current weights is shared: `clear()` at each weight change."""

    def __init__(self):
        self._by_hash: dict[int, dict[int, object]] = {}  # hash -> {seq_id: sequence}
        self._hashes: dict[int, list[int]] = {}  # seq_id -> its hashes

    def register(self, seq) -> None:
        """`seq` was admitted: its prefill ids' K/V is in its slot after its first pass."""
        self._hashes[seq.seq_id] = block_hashes(seq.prefill_ids)
        for h in self._hashes[seq.seq_id]:
            self._by_hash.setdefault(h, {})[seq.seq_id] = seq

    def release(self, seq_id: int) -> None:
        for h in self._hashes.pop(seq_id, ()):
            bucket = self._by_hash[h]
            bucket.pop(seq_id, None)
            if not bucket:
                del self._by_hash[h]

    def clear(self) -> None:
        self._by_hash.clear(), self._hashes.clear()

    def find(self, ids: list[int], pending: set[int]):
        """(donor, positions) for the donor sharing the longest prefix with `ids` (at most
        len(ids) - 1, at least a block), or 'wait' when only a sequence admitted in this pass
        (`pending`: its K/V is not computed yet) shares it, or None."""
        deepest = _deepest(self._by_hash, ids)
        best, best_n, wait = None, 0, False
        for seq_id in sorted(deepest):  # the oldest first: ties go to it
            if seq_id in pending:
                wait = True
                continue
            donor = deepest[seq_id]
            n = _common(donor.prefill_ids[:donor.cached], ids, len(ids) - 1)
            if n > best_n:
                best, best_n = donor, n
        if best_n >= BLOCK:
            return best, best_n
        return "wait" if wait else None
