"""Attention over packed rows by segments, without a dense (tokens x tokens) mask.

A packed row (rollwise.training.packing) is a token trie: a prompt, then each response as a
segment hanging from the prompt's last token (or, for a tree's children, from a node of an
earlier response). A segment's tokens attend to their ancestors (a few ranges of earlier
columns: the prompt, a parent's shared prefix) and causally to their own segment. Through a
dense (L x L) mask per row, SDPA computes every query against every key of the row: with G
responses of length l after a prompt of P, (P + G l)^2 scores where G l (P + l) are needed,
about 5x the work for 8 responses of 130 tokens after a 100-token prompt.

Here each segment is gathered with its context: queries (its own tokens) and keys (its
ancestors' columns, then its own), and segments of similar sizes run as one batched SDPA call:
a segment with no ancestors (a block's first sample: its prompt and response) causally with no
mask at all, the others with a mask of (segment length x context + segment length) per
segment. The outputs are scattered back to the row's columns; columns of no segment (row
padding) get zeros. Every query sees exactly the keys the dense mask allows it, so the result
equals the dense pass up to float rounding (tests/training/test_train_packing.py).

The layout reaches the attention function as a keyword argument of the model's forward pass,
which Hugging Face models hand down to every attention call, gradient checkpointing's
recomputation included. Without it the function is SDPA itself, so a model switched to it
(enable()) runs every other pass as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTN_NAME = "rollwise_packed"
SLACK = 1.25  # segments batched together differ in length (and context) by at most this factor


@dataclass
class Segment:
    row: int
    start: int  # its first column in the row
    length: int
    context: list[tuple[int, int]]  # ancestor column ranges [lo, hi], inclusive, in order


@dataclass
class Bucket:
    """Segments run as one SDPA call: S segments of l query positions each (padded), their
    keys c + l (context, then own), and the mask (S, 1, l, c + l), None for segments without
    context (causal)."""
    segments: int
    queries: int
    keys: int
    mask: torch.Tensor | None


@dataclass
class SegmentLayout:
    """Flat (row * L + column) indices of every bucket's queries and keys, concatenated, so a
    layer gathers each of Q, K and V once; `real`: the positions of real queries in that
    concatenation, and `dest`: their columns."""
    rows: int
    length: int
    buckets: list[Bucket]
    queries: torch.Tensor
    keys: torch.Tensor
    real: torch.Tensor
    dest: torch.Tensor

    def to(self, device) -> "SegmentLayout":
        if self.queries.device == torch.device(device):
            return self
        return SegmentLayout(self.rows, self.length, [
            Bucket(b.segments, b.queries, b.keys, None if b.mask is None else b.mask.to(device))
            for b in self.buckets], *(t.to(device) for t in (self.queries, self.keys,
                                                              self.real, self.dest)))

    @property
    def scores(self) -> int:
        """Query-key pairs the buckets compute (padding included)."""
        return sum(b.segments * b.queries * b.keys for b in self.buckets)


def _chunks(segments: list[Segment]) -> list[list[Segment]]:
    """Segments in groups of similar length and context size (SLACK), longest first; those
    without context never share a group with those with it."""
    size = lambda s: sum(hi - lo + 1 for lo, hi in s.context)  # noqa: E731
    ordered = sorted(segments, key=lambda s: (size(s) > 0, -s.length, -size(s)))
    groups: list[list[Segment]] = []
    for s in ordered:
        g = groups[-1] if groups else None
        if g and (size(g[0]) > 0) == (size(s) > 0) and s.length * SLACK >= g[0].length \
                and size(s) * SLACK >= size(g[0]):
            g.append(s)
        else:
            groups.append([s])
    return groups


def layout(segments: list[Segment], rows: int, length: int) -> SegmentLayout:
    buckets, queries, keys, real, dest = [], [], [], [], []
    for group in _chunks(segments):
        ctx = [[c for lo, hi in s.context for c in range(lo, hi + 1)] for s in group]
        n, span, c = len(group), group[0].length, max(len(x) for x in ctx)
        mask = torch.zeros((n, 1, span, c + span), dtype=torch.bool) if c else None
        causal = torch.ones((span, span), dtype=torch.bool).tril()
        for i, (s, cols) in enumerate(zip(group, ctx)):
            base = s.row * length
            own = [base + s.start + min(j, s.length - 1) for j in range(span)]  # pad: last
            real += range(len(queries), len(queries) + s.length)
            dest += own[:s.length]
            queries += own
            keys += [base + x for x in cols] + own[:1] * (c - len(cols)) + own
            if mask is not None:
                mask[i, 0, :, :len(cols)] = True
                mask[i, 0, :, c:] = causal
        buckets.append(Bucket(n, span, c + span, mask))
    return SegmentLayout(rows, length, buckets, *(torch.tensor(x, dtype=torch.long)
                                                  for x in (queries, keys, real, dest)))


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window=None, packed_layout: SegmentLayout | None = None,
                     **kwargs):
    """query (R, heads, L, d), key/value (R, kv_heads, L, d) -> (R, L, heads, d), as Hugging
    Face attention functions return it; SDPA itself when the pass has no packed layout."""
    if packed_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__}: sliding-window, soft-capped or "
                                  f"sink attention over packed segments is not supported")
    R, heads, L, d = query.shape
    lay = packed_layout
    flat = lambda t: t.transpose(1, 2).reshape(R * L, t.shape[1], d)  # noqa: E731
    q_all = flat(query).index_select(0, lay.queries)  # one gather each, one scatter back
    k_all, v_all = (flat(t).index_select(0, lay.keys) for t in (key, value))
    outs = []
    splits = zip(lay.buckets, q_all.split([b.segments * b.queries for b in lay.buckets]),
                 *(t.split([b.segments * b.keys for b in lay.buckets]) for t in (k_all, v_all)))
    for b, q, k, v in splits:  # split, not sliced: the backward pass concatenates once
        q = q.view(b.segments, b.queries, heads, d).transpose(1, 2)
        k, v = (t.view(b.segments, b.keys, t.shape[1], d).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=b.mask, is_causal=b.mask is None, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=heads != k.shape[1])
        outs.append(out.transpose(1, 2).reshape(-1, heads, d))
    real = torch.cat(outs).index_select(0, lay.real)
    out = query.new_zeros((R * L, heads, d)).index_copy(0, lay.dest, real)
    return out.view(R, L, heads, d), None


def enable(model) -> bool:
    """Switch a model that attends by SDPA to packed_attention (SDPA for every pass without a
    layout); False, changing nothing, for any other attention."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == ATTN_NAME:
        return True
    if current != "sdpa":
        return False
    config._attn_implementation = ATTN_NAME
    for module in model.modules():  # submodules holding their own config (vision towers...)
        sub = getattr(module, "config", None)
        if sub is not None and sub is not config and \
                getattr(sub, "_attn_implementation", None) == "sdpa":
            sub._attn_implementation = ATTN_NAME
    return True


def portable(config):
    """The config as another process can build it: a copy attending by SDPA where enable()
    switched it (that process has not registered ATTN_NAME, and needs no layout)."""
    import copy
    if getattr(config, "_attn_implementation", None) != ATTN_NAME and not any(
            getattr(getattr(config, k, None), "_attn_implementation", None) == ATTN_NAME
            for k in getattr(config, "sub_configs", {})):
        return config
    config = copy.deepcopy(config)
    for c in [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", {})]:
        if getattr(c, "_attn_implementation", None) == ATTN_NAME:
            c._attn_implementation = "sdpa"
    return config


def disable(model) -> None:
    """Back to SDPA where enable() switched."""
    for module in model.modules():
        sub = getattr(module, "config", None)
        if getattr(sub, "_attn_implementation", None) == ATTN_NAME:
            sub._attn_implementation = "sdpa"


AttentionInterface.register(ATTN_NAME, packed_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
