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


def pack(batch: Batch, max_row_tokens: int = 2048) -> Packed:
    """Rows of one prompt and as many of its responses as fit in max_row_tokens (at least one).
    Samples share a row when their prompt token ids are equal, whatever their group."""
    ids, att = batch.input_ids.tolist(), batch.attention_mask.sum(1).tolist()
    plen = batch.prompt_lens.tolist()
    rows: list[tuple[list[int], list[int]]] = []  # (prompt ids, sample indices)
    used: list[int] = []  # tokens in each row
    open_row: dict[tuple[int, ...], int] = {}
    for i in range(batch.size):
        prompt = tuple(ids[i][:plen[i]])
        n = att[i] - plen[i]
        r = open_row.get(prompt)
        if r is None or used[r] + n > max_row_tokens:
            r = open_row[prompt] = len(rows)
            rows.append((list(prompt), []))
            used.append(len(prompt))
        rows[r][1].append(i)
        used[r] += n

    row_ids, row_pos, row_seg = [], [], []  # per row: token ids, positions, segments
    src_row, src_pos, target, dst_row, dst_col = [], [], [], [], []
    for r, (prompt, members) in enumerate(rows):
        P = len(prompt)
        tok, pos, seg = list(prompt), list(range(P)), [0] * P  # segment 0: the prompt
        for k, i in enumerate(members):
            n = att[i] - plen[i]
            response, at = ids[i][P:P + n], len(tok)
            tok += response
            pos += range(P, P + n)
            seg += [k + 1] * n  # segment k+1: response k
            # token j is predicted from the prompt's last position (j = 0) or from token j-1
            src_row += [r] * n
            src_pos += [P - 1] + list(range(at, at + n - 1)) if n else []
            target += response
            dst_row += [i] * n
            dst_col += range(P - 1, P - 1 + n)
        row_ids.append(tok)
        row_pos.append(pos)
        row_seg.append(seg)
    L = max(len(t) for t in row_ids)
    pad = lambda rows_, v: torch.tensor([x + [v] * (L - len(x)) for x in rows_])  # noqa: E731
    input_ids, position_ids, segment = pad(row_ids, 0), pad(row_pos, 0), pad(row_seg, -1)
    q, k = segment[:, :, None], segment[:, None, :]
    pos = torch.arange(L)
    causal = pos[None, :, None] >= pos[None, None, :]
    mask = causal & (k != -1) & ((k == 0) | (k == q)) & (q != -1)
    mask |= torch.eye(L, dtype=torch.bool)[None]  # padding attends to itself: no empty row
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Packed(input_ids, position_ids, mask[:, None], as_long(src_row), as_long(src_pos),
                  as_long(target), as_long(dst_row), as_long(dst_col))


def packed_token_logprobs(model, batch: Batch, packed: Packed, entropy_grad: bool = False):
    """log p(target) and entropy per (B, T-1) target column, as token_logprobs returns them,
    from one forward pass over the packed rows. Columns that are not response targets hold 0."""
    mask = packed.mask
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":  # additive float mask
        mask = torch.zeros(mask.shape, dtype=model.dtype).masked_fill(
            ~mask, torch.finfo(model.dtype).min)
    logits = model(input_ids=packed.input_ids, attention_mask=mask,
                   position_ids=packed.position_ids).logits
    picked = logits[packed.src_row, packed.src_pos].float().log_softmax(-1)  # (N, V)
    shape = (batch.size, batch.input_ids.shape[1] - 1)
    logp = torch.zeros(shape, dtype=picked.dtype).index_put(
        (packed.dst_row, packed.dst_col), picked.gather(-1, packed.target[:, None]).squeeze(-1))
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent_n = -(picked.exp() * picked).sum(-1)
        ent = torch.zeros(shape, dtype=picked.dtype).index_put((packed.dst_row, packed.dst_col),
                                                               ent_n)
    return logp, ent


def worth_packing(batch: Batch, packed: Packed, min_saving: float = 0.8) -> bool:
    """Pack only where it saves compute: packed tokens below min_saving of the padded ones."""
    return packed.tokens < min_saving * batch.input_ids.numel()
