"""The engine's scheduler: pure bookkeeping, no model and no torch.

Each step, `schedule()` decides which sequences run (every running one decodes one token; waiting
ones are admitted into free KV slots and prefilled in the same forward pass), which KV rows must be
copied first (fork), and the shape of the slot cache. After the forward pass and sampling,
`update(plan, output)` appends the sampled tokens, finishes sequences (stop id or length) and frees
their slots at once, and returns the events due (every `segment` tokens and at the end). This is
the split of vLLM's `v1/core/sched` (`schedule()` / `update_from_output()`), and it lets the tests
drive the scheduler with fabricated outputs. `decode_window()` / `update_window()` let the engine
run several decode passes between two `schedule()` calls when nothing could change in between.

Memory: the runner keeps one KV row (slot) per running sequence, all rows one length long (a
rectangle). The scheduler owns that rectangle's shape and keeps rows x length within
`kv_budget_tokens`; a request that would not fit waits until others finish.

Prefix cache (`prefix_cache_tokens` > 0): a sequence that finishes leaves its K/V as an entry of
a PrefixIndex (rollwise/engine/prefix.py); a request admitted later whose ids start with an
entry's gets those positions loaded into its slot (`plan.loads`) and prefills only the rest.
The K/V is copied out of the slot right after the step that finished it (`take_saves`).

Kept pauses (`pause(keep=True)`): the sequence stops but keeps its slot and K/V, so `resume`
puts it back among the running ones with no prefill, even across a weight sync (its K/V then
stays what the old weights computed). A kept sequence holds its rows and positions of the
rectangle; a waiting request that cannot fit evicts kept sequences, the one holding the fewest
positions first (the least prefill to redo), until it fits: an evicted one is an ordinary paused
sequence, and its resume prefills prompt + tokens again.

Shared prefixes (`share_prefix`): a request admitted while a running sequence (admitted under
the current weights) starts with the same ids copies those positions from its slot (a copy
before the pass, like a fork's) and prefills only the rest. One that shares its prefix only with
a request admitted in the same pass waits for the next pass, when that one's K/V exists.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollwise.engine.prefix import LivePrefixes, PrefixIndex

ROW_ALIGN = 8  # the cache grows in steps of 8 rows and 16 positions: rarely reallocated
LEN_ALIGN = 16


class Params(Protocol):  # the fields of SamplingParams the scheduler reads
    max_new_tokens: int
    stop_ids: tuple[int, ...]


class SeqStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Sequence:
    """One request in flight: its prompt, the tokens sampled so far and their per-token columns."""

    seq_id: int
    request_id: Any  # the caller's tag, carried to events and completions
    prompt: list[int]
    params: Any  # SamplingParams (max_new_tokens counts every response token, inherited ones too)
    rng: Any = None  # the sequence's own uniform stream (sampling.SeedStream)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    hidden: Any = None  # last hidden state of the latest token (when params.return_hidden)
    parent: int | None = None  # seq_id this was forked from
    branch_point: int = 0  # tokens[:branch_point] were inherited from the parent
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort", "paused"
    slot: int | None = None
    cached: int = 0  # positions 0..cached-1 of the slot hold this sequence's K/V
    emitted: int = 0  # tokens already reported in events
    prefix_entry: int | None = None  # the prefix-cache entry its K/V was loaded from
    prefix_hit: int = 0  # positions loaded at its latest admission, not yet in an event

    @property
    def reservation(self) -> int:
        """KV positions this sequence may need: prompt + every response token."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """What a (re-)prefill feeds: the prompt and any partial response (resume, late fork)."""
        return self.prompt + self.tokens

    def done_reason(self) -> str | None:
        if self.tokens and self.tokens[-1] in self.params.stop_ids:
            return "stop"
        if len(self.tokens) >= self.params.max_new_tokens:
            return "length"
        return None


@dataclass
class StepPlan:
    """One forward pass: decode rows first (one token each), then prefill rows: those from
    position 0 first, then those extending K/V loaded from the prefix cache (their `cached`
    positions are in their slots before the pass; they feed prefill_ids[cached:])."""

    decode: list[Sequence]
    prefill: list[Sequence]
    copies: list[tuple[int, int, int]]  # (src slot, dst slot, positions) to copy before the pass
    cache_rows: int
    cache_len: int
    shared: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (prefix entry, slot,
    # positions) to load into the slot cache before the pass
    """(follower, leader): same prefill ids as a leader prefilled in this pass; the follower
    samples from the leader's logits and gets its K/V copied after the pass (a group's samples
    share one prompt prefill)."""
    after_copies: list[tuple[int, int, int]] = field(init=False)  # leader -> follower rows
    num_tokens: int = field(init=False)  # tokens through the model in this pass

    def __post_init__(self):  # fixed now: update() changes the sequences afterwards
        self.after_copies = [(lead.slot, f.slot, len(lead.prefill_ids))  # type: ignore
                             for f, lead in self.shared]
        self.num_tokens = len(self.decode) + sum(len(s.prefill_ids) - s.cached
                                                 for s in self.prefill)

    @property
    def sequences(self) -> list[Sequence]:
        """Sampled rows, in the order of the runner's outputs."""
        return self.decode + self.prefill + [f for f, _ in self.shared]


@dataclass
class StepOutput:
    """What the runner and sampler produced for `plan.sequences`, row by row."""

    tokens: list[int]
    logprobs: list[float]
    entropies: list[float]
    version: int
    top_logprobs: list[list[tuple[int, float]]] | None = None
    hidden: list[Any] | None = None


@dataclass
class Event:
    """New tokens of one sequence since its last event; `finished` on its last one."""

    seq_id: int
    request_id: Any
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    versions: list[int]
    finished: bool
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    hidden: Any = None
    cached_tokens: int = 0  # prompt positions its request took from the prefix cache, itself or
    # through the request whose prefill it shared (on the first event after each admission;
    # vLLM: num_cached_tokens)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class Scheduler:
    def __init__(self, max_slots: int, *, kv_budget_tokens: int | None = None,
                 max_prefill_tokens: int = 8192, segment: int = 16,
                 prefix_cache_tokens: int = 0, share_prefix: bool = False):
        if max_slots < 1 or segment < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_slots={max_slots}, segment={segment}, max_prefill_tokens="
                             f"{max_prefill_tokens}: each must be >= 1")
        self.max_slots = max_slots
        self.kv_budget_tokens = kv_budget_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.segment = segment
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self.paused: dict[int, Sequence] = {}
        self.kept: dict[int, Sequence] = {}  # paused with their slot and K/V (pause(keep=True))
        self.evicted_kept = 0  # kept sequences whose K/V was dropped to admit others
        self.kept_resumed_tokens = 0  # positions resumed from kept K/V instead of prefilled
        self.free_slots: list[int] = list(range(max_slots))  # a heap: lowest first
        self.cache_rows = 0
        self.cache_len = 0
        self._copies: list[tuple[int, int, int]] = []
        self.fork_tokens_saved = 0  # K/V positions forks copied instead of prefilling again
        self.prefix = PrefixIndex(prefix_cache_tokens) if prefix_cache_tokens else None
        self.prefix_hit_tokens = 0  # K/V positions loaded from the prefix cache
        self.finished = 0  # sequences run to their end (a stop token or the length limit)
        self.live = LivePrefixes() if share_prefix else None
        self.shared_prefix_tokens = 0  # K/V positions copied from running sequences
        self._saves: list[tuple[int, int, int]] = []  # (slot, entry, positions) to copy out
        self._drops: list[int] = []  # entries whose K/V the runner may free

    # ---- requests in -----------------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        self._check_fits(seq)
        seq.status, seq.slot, seq.cached = SeqStatus.WAITING, None, 0
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def _check_fits(self, seq: Sequence) -> None:
        need = _round_up(seq.reservation, LEN_ALIGN)
        if self.kv_budget_tokens is not None and need > self.kv_budget_tokens:
            raise ValueError(
                f"request {seq.request_id!r} needs {seq.reservation} KV positions (prompt "
                f"{len(seq.prompt)} + max_new_tokens {seq.params.max_new_tokens}), {need} with "
                f"alignment, over kv_budget_tokens={self.kv_budget_tokens}: raise "
                f"the budget or shorten the request")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, seq_id: int) -> Sequence:
        for seq in (self.running.get(seq_id), self.paused.get(seq_id), self.kept.get(seq_id)):
            if seq is not None:
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                return seq
        raise KeyError(f"sequence {seq_id} is not waiting, running or paused (finished, "
                       f"aborted, or never added)")

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._compact()
        decode = sorted(self.running.values(), key=lambda q: q.slot)  # slots 0..n-1
        prefill: list[Sequence] = []
        shared: list[tuple[Sequence, Sequence]] = []
        leaders: dict[tuple[int, ...], Sequence] = {}
        loads: list[tuple[int, int, int]] = []
        admitted: set[int] = set()  # this pass's: no K/V to share until it has run
        budget = self.max_prefill_tokens
        while self.waiting:
            seq = self.waiting[0]
            key = tuple(seq.prefill_ids)
            leader = leaders.get(key)
            shape = self._room_for(seq)
            if shape is None:
                break
            hit = self.prefix.lookup(seq.prefill_ids) if leader is None and self.prefix \
                else None
            share = self.live.find(seq.prefill_ids, admitted) if leader is None and \
                hit is None and self.live is not None else None
            if share == "wait":
                break
            fed = len(key) - (hit[1] if hit else share[1] if share else 0)
            if leader is None and prefill and fed > budget:
                break
            self.waiting.popleft()
            self._place(seq, shape)
            admitted.add(seq.seq_id)
            if self.live is not None:
                self.live.register(seq)
            if share:
                donor, seq.cached = share
                self._copies.append((donor.slot, seq.slot, seq.cached))
                self.shared_prefix_tokens += seq.cached
            seq.prefix_entry, seq.prefix_hit = hit if hit else (None, 0)
            if hit:
                seq.cached = hit[1]
                loads.append((hit[0], seq.slot, hit[1]))  # type: ignore[arg-type]
                self.prefix_hit_tokens += hit[1]
            if leader is None:
                prefill.append(seq)
                leaders[key] = seq
                budget -= fed
            else:  # its K/V is the leader's, copied: it reused what the leader loaded
                shared.append((seq, leader))
                seq.prefix_entry, seq.prefix_hit = leader.prefix_entry, leader.prefix_hit
        prefill.sort(key=lambda q: q.cached > 0)  # from position 0 first, then extensions
        # shrink (or give back when idle) once finished and paused sequences left it too big
        self.cache_rows, self.cache_len = self._fit(*self._occupied()) or (self.cache_rows,
                                                                           self.cache_len)
        copies, self._copies = self._copies, []
        return StepPlan(decode, prefill, copies, self.cache_rows, self.cache_len, shared, loads)

    def _compact(self) -> None:
        """Move running sequences from high slots into freed low ones (a K/V row copy each),
        so the running ones hold slots 0..n-1 and the runner reads their cache rows as one
        slice instead of gathering them every step. Kept sequences in those low slots move
        up first, to free slots past them (copies run in order)."""
        n = len(self.running)
        movers = sorted((q for q in self.running.values() if q.slot >= n), key=lambda q: q.slot)
        if not movers:
            return
        free = set(self.free_slots)
        for seq in sorted((q for q in self.kept.values() if q.slot < n), key=lambda q: q.slot):
            up = min((x for x in free if x >= n), default=None)
            if up is None:  # every slot is taken: the runner gathers the rows instead
                break
            self._move(seq, up, free)
        holes = sorted(x for x in free if x < n)
        for seq, hole in zip(movers, holes):
            self._move(seq, hole, free)
        self.free_slots = sorted(free)  # a sorted list is a valid heap

    def _move(self, seq: Sequence, slot: int, free: set[int]) -> None:
        self._copies.append((seq.slot, slot, seq.cached))  # type: ignore[arg-type]
        free.add(seq.slot)  # type: ignore[arg-type]
        free.discard(slot)
        seq.slot = slot

    def _occupied(self) -> tuple[int, int]:
        """Rows and positions the running and kept sequences need."""
        held = [*self.running.values(), *self.kept.values()]
        rows = max((s.slot + 1 for s in held), default=0)
        return rows, max((s.reservation for s in held), default=0)

    def _room_for(self, seq: Sequence):
        """The cache shape that admits `seq` now beside what is running and kept, evicting kept
        sequences until it fits; None while it cannot."""
        while True:
            if self.free_slots:
                rows, length = self._occupied()
                need = max(rows, self.free_slots[0] + 1), max(length, seq.reservation)
                shape = self._fit(*need)
                if shape is not None:
                    return shape
            if not self._evict_kept():
                return None

    def _evict_kept(self) -> bool:
        """Drop the K/V of the kept sequence holding the fewest positions (it stays paused and
        re-prefills on resume); False when none is kept."""
        if not self.kept:
            return False
        seq = min(self.kept.values(), key=lambda q: (q.cached, q.seq_id))
        del self.kept[seq.seq_id]
        heapq.heappush(self.free_slots, seq.slot)  # type: ignore[arg-type]
        if self.live is not None:
            self.live.release(seq.seq_id)
        seq.slot, seq.cached = None, 0
        self.paused[seq.seq_id] = seq
        self.evicted_kept += 1
        return True

    def _fit(self, rows_need: int, len_need: int) -> tuple[int, int] | None:
        """The cache shape for this need, or None if over budget. The current shape is kept
        while it covers the need and is at most twice its size; else the cache grows with
        alignment (rarely reallocated) or, near the budget, fits tightly."""
        if rows_need == 0:
            return 0, 0
        rows = min(_round_up(rows_need, ROW_ALIGN), self.max_slots)
        length = _round_up(len_need, LEN_ALIGN)
        cur_rows, cur_len = self.cache_rows, self.cache_len
        candidates = [(rows, length), (rows_need, length)]
        if rows_need > cur_rows or len_need > cur_len:
            candidates.insert(0, (max(rows, cur_rows), max(length, cur_len)))
        elif cur_rows * cur_len <= 2 * rows * length:
            candidates.insert(0, (cur_rows, cur_len))
        for shape in candidates:
            if not self._over(*shape):
                return shape
        return None

    def _over(self, rows: int, length: int) -> bool:
        return self.kv_budget_tokens is not None and rows * length > self.kv_budget_tokens

    def _place(self, seq: Sequence, shape: tuple[int, int]) -> None:
        seq.slot = heapq.heappop(self.free_slots)
        seq.status = SeqStatus.RUNNING
        self.running[seq.seq_id] = seq
        self.cache_rows, self.cache_len = shape

    def update(self, plan: StepPlan, out: StepOutput) -> list[Event]:
        """Append the sampled tokens; finish, free and report sequences as due."""
        events = []
        for i, seq in enumerate(plan.sequences):
            if seq.status is not SeqStatus.RUNNING:  # aborted or paused during the step
                continue
            seq.cached = len(seq.prompt) + len(seq.tokens)  # every fed token is now in the cache
            seq.tokens.append(out.tokens[i])
            seq.logprobs.append(out.logprobs[i])
            seq.entropies.append(out.entropies[i])
            seq.versions.append(out.version)
            if out.top_logprobs is not None:
                seq.top_logprobs.append(out.top_logprobs[i])
            if out.hidden is not None:
                seq.hidden = out.hidden[i]
            if self._settle(seq):
                events.append(self.event(seq))
        return events

    def decode_window(self, plan: StepPlan) -> int:
        """How many decode steps `plan` may run back to back without scheduling in between (the
        runner then skips the per-step layout, bookkeeping and .tolist()). Only a decode-only
        plan with no copies and nobody who could be admitted runs more than one; the window ends
        at the first step where some sequence reaches its length limit or its next segment
        event, so events come at the same tokens as step by step. A stop id ends a sequence
        inside the window: `update_window` cuts its tokens there (its slot idles to the end)."""
        if plan.prefill or plan.shared or plan.copies or (self.waiting and self.free_slots):
            return 1
        k = self.segment
        for seq in plan.decode:
            n = len(seq.tokens)
            k = min(k, seq.params.max_new_tokens - n, self.every(seq) - (n - seq.emitted))
        return max(k, 1)

    def update_window(self, plan: StepPlan, tokens: list[list[int]],
                      logprobs: list[list[float]], entropies: list[list[float]],
                      version: int, top_logprobs: list | None = None,
                      hidden: list | None = None) -> list[Event]:
        """`update` for a decode window: row i of each list holds plan.decode[i]'s tokens of
        the window (`decode_window` steps), cut after a stop id; `top_logprobs` the same
        rows' per-token lists, `hidden` each row's hidden state at its last kept token."""
        events = []
        for i, (seq, toks, lps, ents) in enumerate(zip(plan.decode, tokens, logprobs,
                                                       entropies)):
            if seq.status is not SeqStatus.RUNNING:
                continue
            stops = seq.params.stop_ids
            cut = next((j + 1 for j, t in enumerate(toks) if t in stops), len(toks)) \
                if stops else len(toks)
            seq.tokens += toks[:cut]
            seq.logprobs += lps[:cut]
            seq.entropies += ents[:cut]
            seq.versions += [version] * cut
            if top_logprobs is not None and seq.params.top_logprobs:
                seq.top_logprobs += top_logprobs[i][:cut]
            if hidden is not None and hidden[i] is not None:
                seq.hidden = hidden[i]
            seq.cached = len(seq.prompt) + len(seq.tokens) - 1
            if self._settle(seq):
                events.append(self.event(seq))
        return events

    def _settle(self, seq: Sequence) -> bool:
        """After new tokens: finish the sequence if it is done; True when an event is due."""
        reason = seq.done_reason()
        if reason is not None:
            self._finish(seq, SeqStatus.FINISHED, reason)
        return reason is not None or len(seq.tokens) - seq.emitted >= self.every(seq)

    def every(self, seq: Sequence) -> int:
        """Tokens between two events of this sequence (its params may ask for fewer)."""
        return getattr(seq.params, "event_every", 0) or self.segment

    def event(self, seq: Sequence) -> Event:
        a = seq.emitted
        seq.emitted = len(seq.tokens)
        hit, seq.prefix_hit = seq.prefix_hit, 0
        return Event(seq.seq_id, seq.request_id, seq.tokens[a:], seq.logprobs[a:],
                     seq.entropies[a:], seq.versions[a:], seq.status is not SeqStatus.RUNNING,
                     seq.finish_reason, seq.top_logprobs[a:] if seq.top_logprobs else None,
                     seq.hidden, hit)

    def _finish(self, seq: Sequence, status: SeqStatus, reason: str) -> None:
        if status is SeqStatus.FINISHED and self.prefix is not None and seq.slot is not None:
            self._keep_prefix(seq)
        self._release(seq)
        seq.status, seq.finish_reason = status, reason
        self.finished += status is SeqStatus.FINISHED

    def _keep_prefix(self, seq: Sequence) -> None:
        """Enter a finished sequence's K/V in the prefix cache (copied out by take_saves);
        the entry it was loaded from is a prefix of it, so that one goes."""
        if seq.prefix_entry is not None and seq.prefix_entry in self.prefix.entries:
            self.prefix.remove(seq.prefix_entry)
            self._drops.append(seq.prefix_entry)
        entry, dropped = self.prefix.insert(seq.prefill_ids[:seq.cached])
        self._drops += dropped
        if entry is not None:
            self._saves.append((seq.slot, entry, seq.cached))  # type: ignore[arg-type]

    def take_saves(self) -> tuple[list[tuple[int, int, int]], list[int]]:
        """(slot, entry, positions) K/V copies into the prefix cache, and entries dropped from
        it, since the last call. Apply them before the next step reuses the slots."""
        out = self._saves, self._drops
        self._saves, self._drops = [], []
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry and donor (the weights changed)."""
        if self.live is not None:
            self.live.clear()
        if self.prefix is not None:
            self._saves = []
            self._drops += self.prefix.clear()

    def _release(self, seq: Sequence) -> None:
        if self.live is not None:
            self.live.release(seq.seq_id)
        if seq.seq_id in self.running:
            del self.running[seq.seq_id]
            heapq.heappush(self.free_slots, seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.seq_id in self.kept:
            del self.kept[seq.seq_id]
            heapq.heappush(self.free_slots, seq.slot)
        self.paused.pop(seq.seq_id, None)
        seq.slot, seq.cached = None, 0

    # ---- control between steps -------------------------------------------------------------
    def abort(self, seq_id: int) -> Sequence:
        """Stop and free a sequence; its tokens count as reported (the caller gets them)."""
        seq = self.get(seq_id)
        self._finish(seq, SeqStatus.ABORTED, "abort")
        seq.emitted = len(seq.tokens)
        return seq

    def pause(self, seq_id: int, keep: bool = False) -> Sequence:
        """Stop a sequence, keeping its tokens for `resume`. keep=False frees its slot (resume
        re-prefills); keep=True holds its slot and K/V (resume continues from them) unless
        it is evicted for room meanwhile. A waiting sequence has no K/V to keep."""
        seq = self.get(seq_id)
        if seq.status is SeqStatus.PAUSED:
            return seq
        if keep and seq.status is SeqStatus.RUNNING:
            del self.running[seq_id]
            seq.status, seq.finish_reason = SeqStatus.PAUSED, "paused"
            self.kept[seq_id] = seq
        else:
            self._finish(seq, SeqStatus.PAUSED, "paused")
            self.paused[seq_id] = seq
        seq.emitted = len(seq.tokens)
        return seq

    def recompute_running(self) -> int:
        """Drop every running sequence's K/V and queue it (ahead of new requests, in its
        order) to prefill prompt + tokens again: the weights changed and loop.carried_kv is
        recompute. Its unreported tokens stay unreported. Returns the positions dropped."""
        dropped = 0
        for seq in reversed(list(self.running.values())):
            dropped += seq.cached
            del self.running[seq.seq_id]
            heapq.heappush(self.free_slots, seq.slot)  # type: ignore[arg-type]
            if self.live is not None:
                self.live.release(seq.seq_id)
            seq.slot, seq.cached, seq.status = None, 0, SeqStatus.WAITING
            self.waiting.appendleft(seq)
        return dropped

    def is_kept(self, seq_id: int) -> bool:
        """Paused with its K/V still in its slot (not evicted)."""
        return seq_id in self.kept

    def resume(self, seq_id: int, front: bool = True) -> Sequence:
        """Continue a paused sequence: a kept one runs again from its K/V at the next pass;
        another is queued (ahead of new requests, as APRIL's partial buffer) to re-prefill."""
        seq = self.paused.get(seq_id) or self.kept.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not paused; pause it before resume")
        if seq.done_reason() is not None:
            raise ValueError(f"sequence {seq_id} already has {len(seq.tokens)} tokens, its "
                             f"max_new_tokens; raise max_new_tokens to resume it")
        seq.finish_reason = None
        if self.kept.pop(seq_id, None) is not None:
            seq.status = SeqStatus.RUNNING
            self.running[seq_id] = seq
            self.kept_resumed_tokens += seq.cached
            return seq
        del self.paused[seq_id]
        self.add(seq, front=front)
        return seq

    def fork(self, parent: Sequence, children: list[Sequence]) -> bool:
        """Add children that continue from the parent's current state. Returns True if they got
        slots at once (their KV is copied from the parent's row, no re-prefill); otherwise they
        wait at the head of the queue and are prefilled from prompt + tokens when admitted."""
        for child in children:
            self._check_fits(child)
        direct = False
        if children and parent.status is SeqStatus.RUNNING and parent.cached > 0 and \
                len(self.free_slots) >= len(children):
            rows_need, len_need = self._occupied()
            need = (max(rows_need, heapq.nsmallest(len(children), self.free_slots)[-1] + 1),
                    max([len_need] + [c.reservation for c in children]))
            shape = self._fit(*need)
            direct = shape is not None
        if direct:
            for child in children:
                self._place(child, shape)  # type: ignore[arg-type]
                child.cached = parent.cached
                self._copies.append((parent.slot, child.slot, parent.cached))  # type: ignore
                self.fork_tokens_saved += parent.cached
            return True
        for child in reversed(children):
            self.add(child, front=True)
        return False
