"""Shared-prefix packing for the trainer's forward passes: prompts, and trees.

The G samples of a group share their prompt, and in RL the prompt is often longer than the
response (the default task: ~12 prompt tokens, ~3 response tokens). Run as a padded batch,
every sample recomputes its prompt. Packed, one row holds the prompt once and then each
response after it:

    [ prompt | response 1 | response 2 | ... ]     positions 0..P-1 | P.. | P.. | ...

with an attention mask that lets each response see the prompt and its own earlier tokens
only, and position ids that restart at P for every response. Every response token then sees
exactly the context it has in the padded layout, so log-probabilities and gradients are the
same up to float rounding, for a fraction of the tokens. The first response token is
predicted from the prompt's last position, shared by all the responses of the row.

The same holds for any shared prefix: a block is a token trie, so a tree's children (which
repeat their parent's tokens up to the branch point) put the shared response prefix through
the model once, and each child's tokens after it attend to that prefix only. The loss is still
computed per sample and token, so a tree trains exactly as its leaves laid out as independent
samples would, for the tokens of the trie.

The result is scattered back into the Batch's (B, T-1) target layout, so the rest of the
trainer does not know the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rollwise.training.head import captured_head
from rollwise.training.packed_attention import ATTN_NAME, Segment, SegmentLayout
from rollwise.training.packed_attention import layout as segment_layout
from rollwise.types import Batch, concat_ranges


@dataclass
class Packed:
    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)
    segments: list[Segment]  # each segment's row, columns and ancestor columns
    src_row: torch.Tensor  # (N,) for each response target: its row in the packed layout,
    src_pos: torch.Tensor  # (N,) the position whose logits predict it,
    target: torch.Tensor  # (N,) the token,
    dst_row: torch.Tensor  # (N,) and where it goes in the Batch's (B, T-1) layout
    dst_col: torch.Tensor  # (N,)
    dense: Callable[[], torch.Tensor] = None  # builds the (R, 1, L, L) bool mask, True where
    # a query may attend to a key: for models whose attention takes only a mask

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def mask(self) -> torch.Tensor:
        return self.dense()

    def layout(self) -> SegmentLayout:
        return segment_layout(self.segments, *self.input_ids.shape)


class _Block:
    """The token trie of one row block: samples that share a prompt, each sharing with the
    earlier ones every token of its longest common prefix (the prompt; a tree's shared
    response prefix; identical opening tokens of i.i.d. samples)."""

    def __init__(self):
        self.tokens: list[int] = []  # per node: its token,
        self.depth: list[int] = []  # its position in the sequence (the position id),
        self.seg: list[int] = []  # its segment (the new nodes of one insert),
        self.kids: dict[int, dict[int, int]] = {}  # node -> {token: child} (root: -1), for
        # children other than the next node of the node's own segment (a chain needs none)
        self.segments: list[tuple[int, int]] = []  # (first node, the node it hangs from or -1)
        self.samples: list[int] = []

    def _child(self, node: int, token: int) -> int | None:
        nxt = node + 1
        if node >= 0 and nxt < len(self.tokens) and self.seg[nxt] == self.seg[node] and \
                self.tokens[nxt] == token:
            return nxt
        return self.kids.get(node, {}).get(token)

    def walk(self, seq: list[int], prompt_len: int) -> list[int]:
        """The nodes of the longest leading part of seq the trie holds already. The block's
        first sample put its prompt, which every sample of the block shares, at nodes
        0..prompt_len-1."""
        nodes = list(range(prompt_len))
        node = prompt_len - 1
        for t in seq[prompt_len:]:
            nxt = self._child(node, t)
            if nxt is None:
                break
            nodes.append(nxt)
            node = nxt
        return nodes

    def insert(self, seq: list[int], shared: list[int]) -> list[int]:
        """The node of each token of seq: `shared` (walk's answer) and the rest of seq added
        as one new segment, a chain hanging from the last shared node."""
        m, start, k = len(shared), len(self.tokens), len(seq) - len(shared)
        if k == 0:
            return shared
        hang = shared[-1] if shared else -1
        self.segments.append((start, hang))
        self.kids.setdefault(hang, {})[seq[m]] = start
        self.tokens += seq[m:]
        self.depth += range(m, len(seq))
        self.seg += [len(self.segments) - 1] * k
        return shared + list(range(start, start + k))

    def ancestry(self) -> list[list[tuple[int, int]]]:
        """Per segment, the node ranges [lo, hi] above it: its hanging node's ancestors (the
        root-to-hang path, a few ranges of earlier segments)."""
        spans: list[list[tuple[int, int]]] = []
        for _, hang in self.segments:
            if hang < 0:
                spans.append([])
            else:
                up = self.seg[hang]
                spans.append(spans[up] + [(self.segments[up][0], hang)])
        return spans


def pack(batch: Batch, max_row_tokens: int = 2048, fill: bool = False) -> Packed:
    """Blocks of one prompt and as many of its samples as fit in max_row_tokens (at least
    one), each block a token trie: every distinct prefix is in the row once, so a prompt shared
    by a group, and the shared response prefix of a tree's children, go through the model once.
    A node attends to its ancestors only and sits at its sequence position, so each response
    token sees exactly its padded-layout context. Samples share a block when their prompt token
    ids are equal, whatever their group. With fill, blocks are then placed first-fit-decreasing
    into rows as long as the longest block, several per row, so that fewer padding tokens go
    through the model."""
    att, plen = batch.attention_mask.sum(1).tolist(), batch.prompt_lens.tolist()
    ids = batch.input_ids.tolist()
    blocks: list[_Block] = []
    nodes: list[list[int]] = [[] for _ in ids]  # per sample: the node of each of its tokens
    open_block: dict[tuple[int, ...], int] = {}
    for i, (n, p) in enumerate(zip(att, plen)):
        seq = ids[i][:n]
        b = open_block.get(tuple(seq[:p]))
        shared = blocks[b].walk(seq, p) if b is not None else []
        if b is None or len(blocks[b].tokens) + n - len(shared) > max_row_tokens:
            b = open_block[tuple(seq[:p])] = len(blocks)
            blocks.append(_Block())
            shared = []
        nodes[i] = blocks[b].insert(seq, shared)
        blocks[b].samples.append(i)

    sizes = [len(b.tokens) for b in blocks]
    place = [(b, 0) for b in range(len(blocks))]  # block -> (row, offset in the row)
    if fill:
        ends: list[int] = []
        longest = max(sizes)
        for b in sorted(range(len(blocks)), key=lambda b: -sizes[b]):
            r = next((r for r, e in enumerate(ends) if e + sizes[b] <= longest), len(ends))
            if r == len(ends):
                ends.append(0)
            place[b] = (r, ends[r])
            ends[r] += sizes[b]
    R, L = max(r for r, _ in place) + 1, max(sizes)
    rows, cols, toks, pos, segs, starts, spans = [], [], [], [], [], [], []  # per node, range
    segments: list[Segment] = []
    first_seg = 0  # segments numbered across blocks
    for blk, (r, o) in zip(blocks, place):
        n = len(blk.tokens)
        rows += [r] * n
        cols += range(o, o + n)
        toks += blk.tokens
        pos += blk.depth
        segs += [first_seg + x for x in blk.seg]
        starts += [o + blk.segments[x][0] for x in blk.seg]
        firsts = [first for first, _ in blk.segments] + [n]
        for s, ranges in enumerate(blk.ancestry()):
            spans += [(first_seg + s, o + lo, o + hi) for lo, hi in ranges]
            segments.append(Segment(r, o + firsts[s], firsts[s + 1] - firsts[s],
                                    [(o + lo, o + hi) for lo, hi in ranges]))
        first_seg += len(blk.segments)
    at = (_long(rows), _long(cols))
    input_ids = torch.zeros((R, L), dtype=torch.long).index_put(at, _long(toks))
    position_ids = torch.zeros((R, L), dtype=torch.long).index_put(at, _long(pos))

    def dense() -> torch.Tensor:
        seg = torch.full((R, L), first_seg, dtype=torch.long).index_put(at, _long(segs))
        start = torch.full((R, L), L, dtype=torch.long).index_put(at, _long(starts))
        # above[s]: the row columns segment s sees above its own nodes; padding
        # (s = first_seg) sees nothing
        above = torch.zeros((first_seg + 1, L), dtype=torch.int16)
        if spans:
            sp = torch.tensor(spans)
            col = torch.arange(L)
            inside = (col >= sp[:, 1:2]) & (col <= sp[:, 2:3])
            above.index_add_(0, sp[:, 0], inside.to(torch.int16))
        causal = torch.ones((L, L), dtype=torch.bool).tril()
        own = (torch.arange(L) >= start[:, :, None]) & causal  # its segment's nodes to itself
        mask = (above > 0)[seg] | own | torch.eye(L, dtype=torch.bool)  # padding sees itself
        return mask[:, None]

    # Response targets in the order block, sample, token: a node shared by several samples
    # predicts a token of each, and its gradient sums them in this order.
    order = torch.tensor([i for blk in blocks for i in blk.samples])
    src_pos = []  # sequence position j is predicted from the node of position j - 1
    for blk, (_, o) in zip(blocks, place):
        for i in blk.samples:
            src_pos += [o + x for x in nodes[i][plen[i] - 1:att[i] - 1]]
    n_resp = (batch.attention_mask.sum(1) - batch.prompt_lens)[order]
    dst_row = order.repeat_interleave(n_resp)
    dst_col = batch.prompt_lens[dst_row] - 1 + concat_ranges(n_resp)
    sample_row = torch.tensor([r for blk, (r, _) in zip(blocks, place) for _ in blk.samples])
    return Packed(input_ids, position_ids, segments, sample_row.repeat_interleave(n_resp),
                  _long(src_pos), batch.input_ids[dst_row, dst_col + 1],
                  dst_row, dst_col, dense)


_PLACEHOLDER = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a ready 4D mask: HF leaves it as is


def _long(values: list[int]) -> torch.Tensor:
    """A long tensor from a Python list, through numpy (several times faster than
    torch.tensor on lists of thousands)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def packed_token_logprobs(model, batch: Batch, packed: Packed, entropy_grad: bool = False,
                          chunk: int | None = None):
    """log p(target) and entropy per (B, T-1) target column, as token_logprobs returns them,
    from one forward pass over the packed rows. Columns that are not response targets hold 0.
    chunk: from the last hidden state, that many tokens at a time (rollwise.training.head);
    None: through the full logits. A model switched to packed attention (enable) attends by
    segments; any other through the dense mask."""
    dev, home = model.device, batch.input_ids.device  # the model's device; the batch stays home
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == ATTN_NAME:  # the mask argument is a placeholder HF passes through unchanged
        attend = {"attention_mask": _PLACEHOLDER.to(dev), "packed_layout": packed.layout().to(dev)}
    elif impl == "eager":  # additive float mask
        attend = {"attention_mask": torch.zeros(packed.mask.shape, dtype=model.dtype).masked_fill(
            ~packed.mask, torch.finfo(model.dtype).min).to(dev)}
    else:
        attend = {"attention_mask": packed.mask.to(dev)}
    src = (packed.src_row.to(dev), packed.src_pos.to(dev))
    run = lambda: model(input_ids=packed.input_ids.to(dev),  # noqa: E731
                        position_ids=packed.position_ids.to(dev), use_cache=False,
                        **attend)  # (no KV cache: see token_logprobs)
    if chunk:
        with captured_head(model, lambda h: h[src], packed.target, chunk, entropy_grad) as got:
            run()
        logp_n, ent_n = got["out"]
    else:
        picked = run().logits[src].float().log_softmax(-1)
        logp_n = picked.gather(-1, packed.target.to(dev)[:, None]).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent_n = -(picked.exp() * picked).sum(-1)
    shape, at = (batch.size, batch.input_ids.shape[1] - 1), (packed.dst_row, packed.dst_col)
    return tuple(torch.zeros(shape, dtype=x.dtype).index_put(at, x.to(home))
                 for x in (logp_n, ent_n))


def worth_packing(batch: Batch, packed: Packed, min_saving: float = 0.8) -> bool:
    """Pack only where it saves compute: packed tokens below min_saving of the padded ones."""
    return packed.tokens < min_saving * batch.input_ids.numel()
