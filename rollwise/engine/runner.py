"""The model runner: one forward pass of a Hugging Face causal LM over a step's tokens, with the
K/V of every running sequence kept in a slot cache.

A step is laid out flat, one token per row: the decode rows first (one pending token per running
sequence), then the tokens of each prefill. The rows go through the unmodified HF model as one
sequence of N tokens with per-row position ids. Two hooks make the layout work for any HF model
written on transformers' attention interface (Qwen2, Llama, Mistral, ...):

- `SlotCache.update` (the Cache protocol each attention layer calls) writes every row's K/V into
  its sequence's slot at its position and returns the whole layer cache;
- `slot_attention` (registered as the attention implementation "rollwise_slots") reads the
  step's `StepLayout`, attends each decode row to its own slot (the scheduler keeps running
  sequences in slots 0..n-1, so that is one slice of the cache, no gather; a key mask only when
  the rows sit at different positions) and runs every prefill causally over the keys of this
  pass, all prefills in one padded call. A prefill that extends K/V loaded from the prefix
  cache attends over its slot's keys instead, with the causal mask shifted by what was loaded.
  The model gets a placeholder 4D mask, which HF's mask preparation passes through untouched.

So a prefill joins the running batch in the same forward pass, and the model's parameters are
used as they are (weights written into `model.state_dict()` in place take effect at once).
`Runner.decode_window` runs several decode-only passes back to back, moving the layout one
position on per pass instead of rebuilding it from the scheduler's sequences.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rollwise.devices import keep_freed_memory
from rollwise.engine.scheduler import StepPlan

ATTN_NAME = "rollwise_slots"


@dataclass
class StepLayout:
    """Where each flat row of a step lives: its slot and position, and how to attend."""

    n_decode: int
    decode_slots: torch.Tensor | None  # (nd,) long; None: the decode rows are slots 0..nd-1
    decode_len: int  # keys 0..decode_len-1 cover every decode row
    decode_mask: torch.Tensor | None  # (nd, 1, 1, decode_len) additive: -inf past a row's
    # position; None when every decode row sits at position decode_len - 1 (nothing to mask)
    prefill_slots: torch.Tensor | None  # (m,) long
    prefill_len: int  # longest prefill (P)
    prefill_index: torch.Tensor | None  # (m, P) long into the prefill rows; None: all equal P
    prefill_valid: torch.Tensor | None  # (m * P,) long: padded positions that are real rows
    slots: torch.Tensor  # (N,) long
    positions: torch.Tensor  # (N,) long
    column: int | None = None  # decode-only step, rows in slots 0..N-1 all at this position
    extend: Extend | None = None  # prefills after K/V loaded from the prefix cache


@dataclass
class Extend:
    """The prefills that continue K/V already in their slots: their rows come last."""

    start: int  # the first of their flat rows
    slots: torch.Tensor  # (e,) long
    index: torch.Tensor  # (e, Q) long into their rows (padded with 0)
    valid: torch.Tensor  # (e * Q,) long: padded positions that are real rows
    keys: int  # K: keys 0..K-1 of the slots cover every extension
    mask: torch.Tensor  # (e, 1, Q, K) bool: key j visible to query i of row r


SavedKV = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]  # K, V by layer: (kv_heads,
# positions, head_dim) each

_ACTIVE = threading.local()  # the StepLayout of the pass running on this thread
# HF models return a ready 4D mask unchanged (masking_utils); slot_attention ignores it and reads
# the layout above, so any model's mask preparation is skipped the same way.
_PLACEHOLDER_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


SPARE_POSITIONS = 1  # allocated past `length` and never used: a decode graph's key slice is
# then never a whole row, so its compiled code has no special case for it (one compilation)


class SlotCache:
    """Per-layer K and V of shape (rows, kv_heads, length + SPARE_POSITIONS, head_dim), one row
    per slot; allocated on a layer's first write, resized to the scheduler's shape each step."""

    is_compileable = False

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.rows = 0
        self.length = 0

    @property
    def num_tokens(self) -> int:
        """Positions held (rows x length): what kv_budget_tokens bounds."""
        return self.rows * self.length if self.k else 0

    def resize(self, rows: int, length: int) -> None:
        if (rows, length) == (self.rows, self.length):
            return
        if rows == 0 or length == 0:
            self.k.clear(), self.v.clear()
        for store in (self.k, self.v):
            for i, old in store.items():
                new = old.new_zeros(rows, old.shape[1], length + SPARE_POSITIONS, old.shape[3])
                r, n = min(rows, self.rows), min(length, self.length)
                new[:r, :, :n] = old[:r, :, :n]
                store[i] = new
        self.rows, self.length = rows, length

    def allocate(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Allocate every layer at the current shape now (a graph pass writes all of them;
        the runner's path allocates each at its first write)."""
        for store in (self.k, self.v):
            for i in range(layers):
                if i not in store:
                    store[i] = torch.zeros(self.rows, kv_heads, self.length + SPARE_POSITIONS,
                                           head_dim, dtype=dtype, device=device)

    def copy(self, src: int, dst: int, n: int) -> None:
        self.copy_many([(src, dst, n)])

    def copy_many(self, copies: list[tuple[int, int, int]]) -> None:
        """Apply (src slot, dst slot, positions) copies in order, batched: one gather and one
        scatter per layer for each run of copies that reads no row written earlier in the run
        (a group's followers, fork children and slot moves come many per step). A destination is
        a slot being handed over, so copying it more positions than asked is harmless."""
        batch: list[tuple[int, int, int]] = []
        written: set[int] = set()
        for c in copies:
            if c[0] in written or c[1] in written:
                self._copy_rows(batch)
                batch, written = [], set()
            batch.append(c)
            written.add(c[1])
        self._copy_rows(batch)

    def _copy_rows(self, batch: list[tuple[int, int, int]]) -> None:
        if not batch:
            return
        n = max(c[2] for c in batch)
        if len(batch) == 1:
            src, dst, _ = batch[0]
            for store in (self.k, self.v):
                for t in store.values():
                    t[dst, :, :n] = t[src, :, :n]
            return
        first = next(iter(self.k.values()), None)
        if first is None:
            return
        src = torch.tensor([c[0] for c in batch], device=first.device)
        dst = torch.tensor([c[1] for c in batch], device=first.device)
        for store in (self.k, self.v):
            for t in store.values():
                view = t[:, :, :n]
                view.index_copy_(0, dst, view.index_select(0, src))

    def read(self, slot: int, n: int) -> SavedKV:
        """A copy of one slot's first n positions: (K, V) by layer."""
        return tuple({i: t[slot, :, :n].clone() for i, t in store.items()}  # type: ignore
                     for store in (self.k, self.v))

    def write(self, slot: int, kv: SavedKV, n: int) -> None:
        """Put the first n positions of what `read` returned into a slot (layers the cache
        gave back while idle are allocated again)."""
        for store, saved in zip((self.k, self.v), kv):
            for i, x in saved.items():
                if i not in store:
                    store[i] = x.new_zeros(self.rows, x.shape[0], self.length + SPARE_POSITIONS,
                                           x.shape[2])
                store[i][slot, :, :n] = x[:, :n]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value (1, kv_heads, N, head_dim): row i goes to (slots[i], positions[i])."""
        if layer_idx not in self.k:
            shape = (self.rows, key.shape[1], self.length + SPARE_POSITIONS, key.shape[3])
            self.k[layer_idx] = key.new_zeros(shape)
            self.v[layer_idx] = value.new_zeros(shape)
        k, v, lay = self.k[layer_idx], self.v[layer_idx], _ACTIVE.layout
        if lay.column is not None:  # one slice, no scatter (equal-length batches)
            n = key.shape[2]
            k[:n, :, lay.column] = key[0].transpose(0, 1)
            v[:n, :, lay.column] = value[0].transpose(0, 1)
        else:
            k[lay.slots, :, lay.positions] = key[0].transpose(0, 1)  # (N, kv_heads, head_dim)
            v[lay.slots, :, lay.positions] = value[0].transpose(0, 1)
        _ACTIVE.fresh = (key, value)  # prefills attend to this pass's keys only
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the layout; HF never needs this when given position_ids


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, sliding_window=None,
                   **kwargs):
    """query (1, heads, N, head_dim); key/value: the layer's whole slot cache. Returns
    (1, N, heads, head_dim) as HF attention functions do."""
    lay: StepLayout = _ACTIVE.layout
    if sliding_window is not None or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"{type(module).__name__}: sliding-window, soft-capped or sink attention is not "
            f"supported by the built-in engine; use the vLLM backend for this model")
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    rows = query[0].transpose(0, 1)  # (N, heads, head_dim)
    nd = lay.n_decode
    parts = []
    if nd:
        q = rows[:nd].reshape(nd, kv_heads, heads // kv_heads, head_dim)  # grouped query heads
        k, v = key[:, :, :lay.decode_len], value[:, :, :lay.decode_len]
        if lay.decode_slots is None:
            k, v = k[:nd], v[:nd]
        else:
            k, v = k.index_select(0, lay.decode_slots), v.index_select(0, lay.decode_slots)
        parts.append(_decode_attention(q, k, v, lay.decode_mask, scaling, head_dim)
                     .reshape(nd, heads, head_dim))
    end = lay.extend.start if lay.extend is not None else rows.shape[0]
    if lay.prefill_slots is not None:  # these prefills start at position 0: their keys are
        m, p = lay.prefill_slots.shape[0], lay.prefill_len  # all in this pass
        fresh_k, fresh_v = (t[0].transpose(0, 1)[nd:end] for t in _ACTIVE.fresh)
        q, k, v = (_pad(x, lay.prefill_index, m, p) for x in (rows[nd:end], fresh_k, fresh_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=heads != kv_heads)
        out = out.transpose(1, 2).reshape(m * p, heads, head_dim)
        parts.append(out if lay.prefill_valid is None else out.index_select(0, lay.prefill_valid))
    if lay.extend is not None:
        parts.append(_extend_attention(rows[end:], key, value, lay.extend, scaling))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0), None


def _extend_attention(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ext: Extend,
                      scaling: float | None) -> torch.Tensor:
    """Prefills continuing K/V in their slots (written there for this pass's rows too): each
    attends over its slot's keys up to its own position. Returns (rows, heads, head_dim)."""
    e, q_len = ext.index.shape
    heads, head_dim = rows.shape[1], rows.shape[2]
    q = _pad(rows, ext.index, e, q_len)
    k = key.index_select(0, ext.slots)[:, :, :ext.keys]
    v = value.index_select(0, ext.slots)[:, :, :ext.keys]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ext.mask, scale=scaling,
                                         enable_gqa=heads != k.shape[1])
    return out.transpose(1, 2).reshape(e * q_len, heads, head_dim).index_select(0, ext.valid)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scaling: float | None, head_dim: int
                      ) -> torch.Tensor:
    """One query row per sequence: q (nd, kv_heads, group, head_dim), k/v (nd, kv_heads, keys,
    head_dim), mask additive (nd, 1, 1, keys) or None. Plain matmuls: for one query per
    sequence they are as fast as SDPA's fused CPU kernel without a mask and faster with one
    (measured on the tiny model); the softmax runs in float32 as HF's eager attention does.
    K and V are read in place: (sequence, kv head) pairs flattened into one batch dimension
    of the cache slice, which is a view, and K transposed by strides, not copied (matmul on
    the 4-D shapes copied K at every layer and step: 9 % of a SmolLM2 decode step)."""
    nd, kv_heads, group, _ = q.shape
    keys = k.shape[2]
    scores = torch.bmm(q.reshape(nd * kv_heads, group, head_dim),
                       k.flatten(0, 1).transpose(1, 2))
    scores.mul_(scaling if scaling is not None else head_dim ** -0.5)
    if mask is not None:
        scores.view(nd, kv_heads, group, keys).add_(mask)
    probs = scores.softmax(-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(probs, v.flatten(0, 1)).view(nd, kv_heads, group, head_dim)


def _pad(flat: torch.Tensor, index: torch.Tensor | None, m: int, p: int) -> torch.Tensor:
    """(tokens, heads, head_dim) of m prefills -> (m, heads, P, head_dim), padded by `index`
    (None: every prefill is P long)."""
    x = flat.view(m, p, *flat.shape[1:]) if index is None else flat[index]
    return x.transpose(1, 2)


AttentionInterface.register(ATTN_NAME, slot_attention)


def build_layout(plan: StepPlan, device: torch.device, dtype: torch.dtype
                 ) -> tuple[StepLayout, list[int], list[int] | None]:
    """The StepLayout of a plan, the flat input ids, and the rows whose logits are sampled
    (None: every row, a decode-only step)."""
    nd = len(plan.decode)
    ids = [s.tokens[-1] for s in plan.decode]
    slots = [s.slot for s in plan.decode]
    positions = [s.cached for s in plan.decode]
    keep = None if not plan.prefill else list(range(nd))
    lengths, starts = [], []
    for s in plan.prefill:
        seq_ids = s.prefill_ids[s.cached:]
        ids += seq_ids
        slots += [s.slot] * len(seq_ids)
        positions += range(s.cached, s.cached + len(seq_ids))
        lengths.append(len(seq_ids))
        starts.append(s.cached)
        keep.append(len(ids) - 1)  # type: ignore[union-attr]
    fresh = sum(1 for c in starts if c == 0)  # the scheduler puts them first
    extend = _extend_layout(lengths[fresh:], starts[fresh:], slots, len(ids) -
                            sum(lengths[fresh:]), device) if fresh < len(starts) else None
    lengths = lengths[:fresh]
    if plan.prefill:
        last_row = {id(s): keep[nd + j] for j, s in enumerate(plan.prefill)}  # type: ignore
        keep += [last_row[id(lead)] for _, lead in plan.shared]  # type: ignore[operator]

    def t(x):
        return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

    decode_slots = decode_mask = None
    decode_len = max(positions[:nd], default=-1) + 1
    if nd:
        if slots[nd - 1] != nd - 1 or slots[:nd] != list(range(nd)):
            decode_slots = t(slots[:nd])
        if min(positions[:nd]) != decode_len - 1:  # rows at different positions: mask the keys
            decode_mask = _decode_mask(t(positions[:nd]), decode_len, dtype)
    prefill_slots = prefill_index = prefill_valid = None
    p = max(lengths, default=0)
    if lengths:
        prefill_slots = t([s.slot for s in plan.prefill[:fresh]])
        if min(lengths) != p:
            prefill_index, prefill_valid = _padding(lengths, device)
    column = decode_len - 1 if nd and not plan.prefill and decode_slots is None and \
        decode_mask is None else None
    layout = StepLayout(nd, decode_slots, decode_len, decode_mask, prefill_slots, p,
                        prefill_index, prefill_valid, t(slots), t(positions), column, extend)
    return layout, ids, keep


def _padding(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid end to end with these lengths: (m, P) indices of each one's rows (0 past
    its end) and the flat positions of the padded (m * P) layout that are real rows."""
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    ar = torch.arange(max(lengths))
    valid = ar[None, :] < torch.tensor(lengths)[:, None]  # (m, P)
    index = (torch.tensor(offsets)[:, None] + ar[None, :]).where(valid, 0)
    return index.to(device), valid.flatten().nonzero().squeeze(1).to(device)


def _extend_layout(lengths: list[int], starts: list[int], slots: list[int], first: int,
                   device: torch.device) -> Extend:
    """Layout of prefills whose K/V up to `starts` is in their slots; their flat rows begin at
    `first`. Query i of row r sits at position starts[r] + i and sees keys 0..that position."""
    index, valid = _padding(lengths, device)
    offsets = index[:, 0].tolist()
    keys = max(s + n for s, n in zip(starts, lengths))
    pos = torch.tensor(starts)[:, None] + torch.arange(index.shape[1])[None, :]  # (e, Q)
    mask = torch.arange(keys)[None, None, :] <= pos[:, :, None]  # padded queries see keys too
    return Extend(first, torch.tensor([slots[first + o] for o in offsets], device=device), index,
                  valid, keys, mask[:, None].to(device))


def advance(lay: StepLayout) -> StepLayout:
    """The layout of the next pass of a decode window: every row one position further on."""
    positions, mask = lay.positions + 1, lay.decode_mask
    if mask is not None:
        mask = _decode_mask(positions, lay.decode_len + 1, mask.dtype)
    return dataclasses.replace(
        lay, decode_len=lay.decode_len + 1, decode_mask=mask, positions=positions,
        column=None if lay.column is None else lay.column + 1)


def _decode_mask(positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(nd, 1, 1, length) additive mask: -inf on the keys past each row's position."""
    past = torch.arange(length, device=positions.device)[None, :] > positions[:, None]
    mask = torch.zeros(past.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(past, float("-inf"))[:, None, None, :]


def cache_kwarg(model) -> str:
    """The forward argument that takes a KV cache: `cache` in newer transformers (where
    `past_key_values` is deprecated and warns on every call), `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Runner:
    """Runs the model for a StepPlan; owns the slot cache. The model's parameters are the live
    weights: nothing is copied out of them."""

    def __init__(self, model):
        self.model = model
        self.cache = SlotCache()
        self.prefixes: dict[int, SavedKV] = {}  # prefix-cache entry -> its K/V
        self._hidden: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings: the engine "
                             f"needs a causal LM (AutoModelForCausalLM)")
        self._head = head  # hooked only for passes that want hidden states: engines made on a
        # shared model (copy_model=False) must leave no hook behind
        self._cache_kwarg = cache_kwarg(model)
        if self.device.type == "cpu":
            keep_freed_memory()  # each step's temporaries reuse freed memory, no page faults

    def _capture_hidden(self, module, args):
        self._hidden = args[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextmanager
    def _slot_attention(self):
        """Switch the model to slot attention for one pass (the model may be shared)."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    @torch.inference_mode()
    def forward(self, plan: StepPlan, want_hidden: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (n, vocab) for `plan.sequences`, in order, and their last hidden states."""
        layout, ids, keep = self._prepare(plan)
        self._hidden = None
        device = layout.positions.device
        hook = self._head.register_forward_pre_hook(self._capture_hidden) if want_hidden else None
        try:
            with self._pass_mode():
                logits = self._run(torch.tensor(ids, dtype=torch.long)[None].to(device), layout,
                                   0 if keep is None else torch.tensor(keep).to(device))
        finally:
            if hook is not None:
                hook.remove()
        self.cache.copy_many(plan.after_copies)
        hidden = self._hidden[0] if want_hidden and self._hidden is not None else None
        return logits, hidden

    @torch.inference_mode()
    def decode_window(self, plan: StepPlan, steps: int,
                      choose: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Up to `steps` decode passes of a decode-only plan back to back: each pass feeds the
        tokens `choose(logits)` picked from the previous one, one position further on; None
        from `choose` ends the window early."""
        layout, ids, _ = self._prepare(plan)
        ids_t = torch.tensor(ids, dtype=torch.long).to(layout.positions.device)
        with self._pass_mode():
            for i in range(steps):
                if i:
                    layout = advance(layout)
                picked = choose(self._run(ids_t[None], layout, 0))
                if picked is None:
                    return
                ids_t = picked

    def prepare(self, plan: StepPlan) -> None:
        """The slot cache as the plan needs it: its shape, fork and compaction copies, prefix
        loads (what every path does before its pass)."""
        if plan.copies:  # copies may read rows the new shape drops: grow, copy, then shrink
            self.cache.resize(max(plan.cache_rows, self.cache.rows),
                              max(plan.cache_len, self.cache.length))
            self.cache.copy_many(plan.copies)
        self.cache.resize(plan.cache_rows, plan.cache_len)
        for entry, slot, n in plan.loads:
            self.cache.write(slot, self.prefixes[entry], n)

    def _prepare(self, plan: StepPlan) -> tuple[StepLayout, list[int], list[int] | None]:
        self.prepare(plan)
        param = next(self.model.parameters())
        return build_layout(plan, param.device, param.dtype)

    def keep_prefixes(self, saves: list[tuple[int, int, int]], drops: list[int]) -> None:
        """Copy (slot, entry, positions) out of the slot cache, then free dropped entries."""
        for slot, entry, n in saves:
            self.prefixes[entry] = self.cache.read(slot, n)
        for entry in drops:
            self.prefixes.pop(entry, None)

    @contextmanager
    def _pass_mode(self):
        """Slot attention and eval mode for the passes (a shared model may be mid-training:
        no dropout here), restored afterwards."""
        training = self.model.training
        try:
            if training:
                self.model.eval()
            with self._slot_attention():
                yield
        finally:
            _ACTIVE.layout = _ACTIVE.fresh = None
            if training:
                self.model.train()

    def _run(self, ids: torch.Tensor, layout: StepLayout, keep) -> torch.Tensor:
        _ACTIVE.layout = layout
        out = self.model(input_ids=ids, position_ids=layout.positions[None],
                         attention_mask=self._placeholder(ids.device),
                         use_cache=True, logits_to_keep=keep, **{self._cache_kwarg: self.cache})
        return out.logits[0]

    def _placeholder(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = _PLACEHOLDER_MASK.to(device)
        return self._mask

    def release(self) -> None:
        self.cache.resize(0, 0)
