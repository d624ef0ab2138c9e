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
  sequences in slots 0..n-1, so that is one slice of the cache, no gather) and runs every prefill
  causally over the keys of this pass, all prefills in one padded call. The model gets a
  placeholder 4D mask, which HF's mask preparation passes through untouched.

So a prefill joins the running batch in the same forward pass, and the model's parameters are
used as they are (weights written into `model.state_dict()` in place take effect at once).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rollwise.engine.scheduler import StepPlan

ATTN_NAME = "rollwise_slots"


@dataclass
class StepLayout:
    """Where each flat row of a step lives: its slot and position, and how to attend."""

    n_decode: int
    decode_slots: torch.Tensor | None  # (nd,) long; None: the decode rows are slots 0..nd-1
    decode_len: int  # keys 0..decode_len-1 cover every decode row
    decode_mask: torch.Tensor | None  # (nd, 1, 1, decode_len) bool: key position <= row position
    prefill_slots: torch.Tensor | None  # (m,) long
    prefill_len: int  # longest prefill (P)
    prefill_index: torch.Tensor | None  # (m, P) long into the prefill rows; None: all equal P
    prefill_valid: torch.Tensor | None  # (m * P,) long: padded positions that are real rows
    slots: torch.Tensor  # (N,) long
    positions: torch.Tensor  # (N,) long


_ACTIVE = threading.local()  # the StepLayout of the pass running on this thread
# HF models return a ready 4D mask unchanged (masking_utils); slot_attention ignores it and reads
# the layout above, so any model's mask preparation is skipped the same way.
_PLACEHOLDER_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


class SlotCache:
    """Per-layer K and V of shape (rows, kv_heads, length, head_dim), one row per slot; allocated
    on a layer's first write, resized to the scheduler's shape each step."""

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
                new = old.new_zeros(rows, old.shape[1], length, old.shape[3])
                r, n = min(rows, self.rows), min(length, self.length)
                new[:r, :, :n] = old[:r, :, :n]
                store[i] = new
        self.rows, self.length = rows, length

    def copy(self, src: int, dst: int, n: int) -> None:
        for store in (self.k, self.v):
            for t in store.values():
                t[dst, :, :n] = t[src, :, :n]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value (1, kv_heads, N, head_dim): row i goes to (slots[i], positions[i])."""
        if layer_idx not in self.k:
            shape = (self.rows, key.shape[1], self.length, key.shape[3])
            self.k[layer_idx] = key.new_zeros(shape)
            self.v[layer_idx] = value.new_zeros(shape)
        k, v, lay = self.k[layer_idx], self.v[layer_idx], _ACTIVE.layout
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
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.decode_mask, scale=scaling)
        parts.append(out.reshape(nd, heads, head_dim))
    if lay.prefill_slots is not None:  # every prefill starts at position 0: its keys are all
        m, p = lay.prefill_slots.shape[0], lay.prefill_len  # in this pass
        fresh_k, fresh_v = (t[0].transpose(0, 1)[nd:] for t in _ACTIVE.fresh)
        q, k, v = (_pad(x, lay, m, p) for x in (rows[nd:], fresh_k, fresh_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=heads != kv_heads)
        out = out.transpose(1, 2).reshape(m * p, heads, head_dim)
        parts.append(out if lay.prefill_valid is None else out.index_select(0, lay.prefill_valid))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0), None


def _pad(flat: torch.Tensor, lay: StepLayout, m: int, p: int) -> torch.Tensor:
    """(tokens, heads, head_dim) of the prefills -> (m, heads, P, head_dim), padded."""
    x = flat.view(m, p, *flat.shape[1:]) if lay.prefill_index is None \
        else flat[lay.prefill_index]
    return x.transpose(1, 2)


AttentionInterface.register(ATTN_NAME, slot_attention)


def build_layout(plan: StepPlan, device: torch.device) -> tuple[StepLayout, list[int], list[int]]:
    """The StepLayout of a plan, the flat input ids, and the rows whose logits are sampled."""
    nd = len(plan.decode)
    ids = [s.tokens[-1] for s in plan.decode]
    slots = [s.slot for s in plan.decode]
    positions = [s.cached for s in plan.decode]
    keep = list(range(nd))
    lengths = []
    for s in plan.prefill:
        seq_ids = s.prefill_ids
        ids += seq_ids
        slots += [s.slot] * len(seq_ids)
        positions += range(len(seq_ids))
        lengths.append(len(seq_ids))
        keep.append(len(ids) - 1)
    last_row = {id(s): keep[nd + j] for j, s in enumerate(plan.prefill)}
    keep += [last_row[id(lead)] for _, lead in plan.shared]  # followers: the leader's logits

    def t(x):
        return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

    decode_slots = decode_mask = None
    decode_len = max(positions[:nd], default=-1) + 1
    if nd:
        if slots[:nd] != list(range(nd)):
            decode_slots = t(slots[:nd])
        pos = t(positions[:nd])
        decode_mask = (torch.arange(decode_len, device=device)[None, :] <= pos[:, None])
        decode_mask = decode_mask[:, None, None, :]
    prefill_slots = prefill_index = prefill_valid = None
    p = max(lengths, default=0)
    if lengths:
        prefill_slots = t([s.slot for s in plan.prefill])
        if min(lengths) != p:
            starts = [0]
            for n in lengths[:-1]:
                starts.append(starts[-1] + n)
            ar = torch.arange(p)
            valid = ar[None, :] < torch.tensor(lengths)[:, None]  # (m, P)
            prefill_index = (torch.tensor(starts)[:, None] + ar[None, :]).where(valid, 0)
            prefill_index = prefill_index.to(device)
            prefill_valid = valid.flatten().nonzero().squeeze(1).to(device)
    layout = StepLayout(nd, decode_slots, decode_len, decode_mask, prefill_slots, p,
                        prefill_index, prefill_valid, t(slots), t(positions))
    return layout, ids, keep


class Runner:
    """Runs the model for a StepPlan; owns the slot cache. The model's parameters are the live
    weights: nothing is copied out of them."""

    def __init__(self, model):
        self.model = model
        self.cache = SlotCache()
        self._hidden: torch.Tensor | None = None
        self._want_hidden = False
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings: the engine "
                             f"needs a causal LM (AutoModelForCausalLM)")
        head.register_forward_pre_hook(self._capture_hidden)

    def _capture_hidden(self, module, args):
        if self._want_hidden:
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
        device = self.device
        if plan.copies:  # copies may read rows the new shape drops: grow, copy, then shrink
            self.cache.resize(max(plan.cache_rows, self.cache.rows),
                              max(plan.cache_len, self.cache.length))
            for src, dst, n in plan.copies:
                self.cache.copy(src, dst, n)
        self.cache.resize(plan.cache_rows, plan.cache_len)
        layout, ids, keep = build_layout(plan, device)
        self._want_hidden, self._hidden = want_hidden, None
        ids_t = torch.tensor(ids, dtype=torch.long)[None].to(device)
        _ACTIVE.layout = layout
        training = self.model.training  # a shared model may be mid-training: no dropout here
        try:
            if training:
                self.model.eval()
            with self._slot_attention():
                out = self.model(input_ids=ids_t, position_ids=layout.positions[None],
                                 attention_mask=_PLACEHOLDER_MASK.to(device),
                                 past_key_values=self.cache, use_cache=True,
                                 logits_to_keep=torch.tensor(keep).to(device))
        finally:
            _ACTIVE.layout = _ACTIVE.fresh = None
            if training:
                self.model.train()
        for src, dst, n in plan.after_copies:
            self.cache.copy(src, dst, n)
        hidden = self._hidden[0] if want_hidden and self._hidden is not None else None
        return out.logits[0], hidden

    def release(self) -> None:
        self.cache.resize(0, 0)
