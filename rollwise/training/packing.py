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

import torch

from rollwise.types import Batch


@dataclass
class Packed:
    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)
    mask: torch.Tensor  # (R, 1, L, L) bool, True where a query may attend to a key
    src_row: torch.Tensor  # (N,) for each response target: its row in the packed layout,
    src_pos: torch.Tensor  # (N,) the position whose logits predict it,
    target: torch.Tensor  # (N,) the token,
    dst_row: torch.Tensor  # (N,) and where it goes in the Batch's (B, T-1) layout
    dst_col: torch.Tensor  # (N,)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


class _Block:
    """The token trie of one row block: samples that share a prompt, each sharing with the
    earlier ones every token of its longest common prefix (the prompt; a tree's shared
    response prefix; identical opening tokens of i.i.d. samples)."""

    def __init__(self):
        self.tokens: list[int] = []  # per node: its token,
        self.depth: list[int] = []  # its position in the sequence (the position id),
        self.seg: list[int] = []  # its segment (the new nodes of one insert),
        self.kids: list[dict[int, int]] = [{}]  # node + 1 -> {token: child node}; [0]: root
        self.segments: list[tuple[int, int]] = []  # (first node, the node it hangs from or -1)
        self.samples: list[int] = []

    def shared(self, seq: list[int]) -> int:
        """How many leading tokens of seq the trie holds already."""
        node, m = 0, 0
        for t in seq:
            nxt = self.kids[node].get(t)
            if nxt is None:
                break
            node, m = nxt + 1, m + 1
        return m

    def insert(self, seq: list[int]) -> list[int]:
        """The node of each token of seq, adding the ones not there yet (one new segment)."""
        nodes, node, new_seg = [], 0, None
        for d, t in enumerate(seq):
            nxt = self.kids[node].get(t)
            if nxt is None:
                if new_seg is None:
                    new_seg = len(self.segments)
                    self.segments.append((len(self.tokens), node - 1))
                nxt = self.kids[node][t] = len(self.tokens)
                self.tokens.append(t)
                self.depth.append(d)
                self.seg.append(new_seg)
                self.kids.append({})
            nodes.append(nxt)
            node = nxt + 1
        return nodes

    def mask(self) -> torch.Tensor:
        """(n, n) bool: a node attends to itself and its ancestors, nothing else."""
        n = len(self.tokens)
        seg = torch.tensor(self.seg, dtype=torch.long)
        base = torch.zeros((len(self.segments), n), dtype=torch.bool)  # ancestors above a segment
        for s, (_, hang) in enumerate(self.segments):
            if hang >= 0:
                up = self.seg[hang]
                base[s] = base[up]
                base[s, self.segments[up][0]:hang + 1] = True
        idx = torch.arange(n)
        own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        return base[seg] | own


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
    block_of = [0] * len(ids)
    open_block: dict[tuple[int, ...], int] = {}
    for i, (n, p) in enumerate(zip(att, plen)):
        seq = ids[i][:n]
        b = open_block.get(tuple(seq[:p]))
        if b is None or (len(blocks[b].tokens) + n - blocks[b].shared(seq) > max_row_tokens):
            b = open_block[tuple(seq[:p])] = len(blocks)
            blocks.append(_Block())
        nodes[i], block_of[i] = blocks[b].insert(seq), b
        blocks[b].samples.append(i)

    sizes = [len(b.tokens) for b in blocks]
    place = [(b, 0) for b in range(len(blocks))]  # block -> (row, offset in the row)
    if fill:
        ends: list[int] = []
        for b in sorted(range(len(blocks)), key=lambda b: -sizes[b]):
            r = next((r for r, e in enumerate(ends) if e + sizes[b] <= max(sizes)), len(ends))
            if r == len(ends):
                ends.append(0)
            place[b] = (r, ends[r])
            ends[r] += sizes[b]
    R, L = max(r for r, _ in place) + 1, max(sizes)
    input_ids = torch.zeros((R, L), dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    mask = torch.eye(L, dtype=torch.bool).repeat(R, 1, 1)  # padding attends to itself
    for blk, (r, o) in zip(blocks, place):
        n = len(blk.tokens)
        input_ids[r, o:o + n] = torch.tensor(blk.tokens)
        position_ids[r, o:o + n] = torch.tensor(blk.depth)
        mask[r, o:o + n, o:o + n] = blk.mask()

    # Response targets in the order block, sample, token: a node shared by several samples
    # predicts a token of each, and its gradient sums them in this order.
    src_row, src_pos, target, dst_row, dst_col = [], [], [], [], []
    for b, blk in enumerate(blocks):
        r, o = place[b]
        for i in blk.samples:  # sequence position j is predicted from the node of j - 1
            p, n = plen[i], att[i]
            src_row += [r] * (n - p)
            src_pos += [o + x for x in nodes[i][p - 1:n - 1]]
            target += ids[i][p:n]
            dst_row += [i] * (n - p)
            dst_col += range(p - 1, n - 1)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Packed(input_ids, position_ids, mask[:, None], t(src_row), t(src_pos), t(target),
                  t(dst_row), t(dst_col))


def packed_token_logprobs(model, batch: Batch, packed: Packed, entropy_grad: bool = False):
    """log p(target) and entropy per (B, T-1) target column, as token_logprobs returns them,
    from one forward pass over the packed rows. Columns that are not response targets hold 0."""
    mask = packed.mask
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":  # additive float mask
        mask = torch.zeros(mask.shape, dtype=model.dtype).masked_fill(
            ~mask, torch.finfo(model.dtype).min)
    dev, home = model.device, batch.input_ids.device  # the model's device; the batch stays home
    logits = model(input_ids=packed.input_ids.to(dev), attention_mask=mask.to(dev),
                   position_ids=packed.position_ids.to(dev), use_cache=False).logits
    # (no KV cache: see token_logprobs)
    picked = logits[packed.src_row.to(dev), packed.src_pos.to(dev)].float().log_softmax(-1)
    shape = (batch.size, batch.input_ids.shape[1] - 1)
    logp_n = picked.gather(-1, packed.target.to(dev)[:, None]).squeeze(-1).to(home)
    logp = torch.zeros(shape, dtype=picked.dtype).index_put((packed.dst_row, packed.dst_col),
                                                            logp_n)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent_n = -(picked.exp() * picked).sum(-1).to(home)
        ent = torch.zeros(shape, dtype=picked.dtype).index_put((packed.dst_row, packed.dst_col),
                                                               ent_n)
    return logp, ent


def worth_packing(batch: Batch, packed: Packed, min_saving: float = 0.8) -> bool:
    """Pack only where it saves compute: packed tokens below min_saving of the padded ones."""
    return packed.tokens < min_saving * batch.input_ids.numel()
