"""Shared-prompt packing for the trainer's forward passes.

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

The result is scattered back into the Batch's (B, T-1) target layout, so the rest of the
trainer does not know the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.types import Batch, concat_ranges


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


def pack(batch: Batch, max_row_tokens: int = 2048, fill: bool = False) -> Packed:
    """Rows of one prompt and as many of its responses as fit in max_row_tokens (at least one).
    Samples share a row when their prompt token ids are equal, whatever their group. With
    fill, these blocks are then placed first-fit-decreasing into rows as long as the longest
    block, several per row, so that fewer padding tokens go through the model."""
    att, plen = batch.attention_mask.sum(1), batch.prompt_lens
    ids, n_resp = batch.input_ids.tolist(), (att - plen).tolist()
    row, off, member = [0] * batch.size, [0] * batch.size, [0] * batch.size  # per sample
    first: list[int] = []  # per row: its first sample, whose prompt the row starts with
    used: list[int] = []  # tokens in each row
    count: list[int] = []  # samples in each row
    open_row: dict[tuple[int, ...], int] = {}
    for i, p in enumerate(plen.tolist()):
        prompt = tuple(ids[i][:p])
        r = open_row.get(prompt)
        if r is None or used[r] + n_resp[i] > max_row_tokens:
            r = open_row[prompt] = len(first)
            first.append(i)
            used.append(p)
            count.append(0)
        row[i], off[i], member[i] = r, used[r], count[r]
        used[r] += n_resp[i]
        count[r] += 1

    # Laid out with tensor ops. The response targets keep the order row, sample, token: the
    # first tokens of a row's responses share one predicting position, whose gradient sums
    # them in this order.
    nblk = len(first)
    place = [(b, 0) for b in range(nblk)]  # block -> (row, offset in the row)
    if fill:
        ends: list[int] = []
        longest = max(used)
        for b in sorted(range(nblk), key=lambda b: -used[b]):
            r = next((r for r, e in enumerate(ends) if e + used[b] <= longest), len(ends))
            if r == len(ends):
                ends.append(0)
            place[b] = (r, ends[r])
            ends[r] += used[b]
    blk_row = torch.tensor([r for r, _ in place], dtype=torch.long)
    blk_off = torch.tensor([o for _, o in place], dtype=torch.long)
    R, L = int(blk_row.max()) + 1, max(used)
    stride = max(count) + 1  # segment ids: block * stride (prompt), + k + 1 (response k)
    blk = torch.tensor(row, dtype=torch.long)
    row = blk_row[blk]
    off = torch.tensor(off, dtype=torch.long) + blk_off[blk]
    member = torch.tensor(member, dtype=torch.long) + blk * stride
    first = torch.tensor(first, dtype=torch.long)
    order = torch.argsort(blk, stable=True)  # samples by block, in sample order within one
    n = (att - plen)[order]
    smp = order.repeat_interleave(n)  # per response token: its sample,
    j = concat_ranges(n)  # its index in the response,
    P = plen[smp]
    dst_row, dst_col = smp, P - 1 + j  # (the Batch's target column)
    src_row, col = row[smp], off[smp] + j  # and where it sits in the packed rows
    src_pos = torch.where(j == 0, blk_off[blk[smp]] + P - 1, col - 1)  # j = 0: prompt's last
    target = batch.input_ids[smp, P + j]
    pblk = torch.arange(nblk).repeat_interleave(plen[first])  # per prompt token: its block,
    pj = concat_ranges(plen[first])  # its position
    prow, pcol = blk_row[pblk], blk_off[pblk] + pj
    input_ids = torch.zeros((R, L), dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segment = torch.full((R, L), -1, dtype=torch.long)  # -1 padding, else as `stride` says
    input_ids[prow, pcol], position_ids[prow, pcol], segment[prow, pcol] = (
        batch.input_ids[first[pblk], pj], pj, pblk * stride)
    input_ids[src_row, col], position_ids[src_row, col], segment[src_row, col] = (
        target, P + j, member[smp] + 1)
    q, k = segment[:, :, None], segment[:, None, :]
    pos = torch.arange(L)
    causal = pos[None, :, None] >= pos[None, None, :]
    prompt_of_q = q - q % stride  # the segment of the query's block prompt
    mask = causal & (k != -1) & ((k == prompt_of_q) | (k == q)) & (q != -1)
    mask |= torch.eye(L, dtype=torch.bool)[None]  # padding attends to itself: no empty row
    return Packed(input_ids, position_ids, mask[:, None], src_row, src_pos, target, dst_row,
                  dst_col)


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
