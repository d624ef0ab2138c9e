"""D³S, dynamic dual-level down-sampling ("Learning More with Less: A Dynamic Dual-Level
Down-Sampling Framework for Efficient Policy Optimization"; docs/methods.md#d3s): train on part
of each step's rollouts and tokens, chosen where the policy gradient is largest
(train.downsample = d3s, train.d3s.*).

Sample level: from each group of n rollouts, the subset of m = max(2, round(r_s n)) whose
advantages have the largest variance (the paper ties it to an upper bound on the policy
gradient's norm). For a fixed size the best subset is always some of the lowest advantages and
the rest of the highest, so it is found among m + 1 candidates after a sort.

Token level: of the tokens left, the share r_t with the largest |A| H (the sample's advantage
times the token's entropy under the policy before the update), over the whole step.

Schedule: r = start + (1 - start) min(step / relax_steps, 1) for both levels: aggressive at
first, everything once relax_steps updates have been made (the paper's curriculum-like
relaxation; its exact schedule is rollwise's reading). Left-out samples and tokens leave the
loss mask, so they count in neither the loss nor its denominators (dropped_tokens/d3s_*).
"""

from __future__ import annotations

import torch


def keep_fraction(step: int, start: float, relax_steps: int) -> float:
    """The share kept at update `step` (0-based): `start`, rising linearly to 1."""
    if relax_steps <= 0:
        return 1.0
    return start + (1.0 - start) * min(step / relax_steps, 1.0)


def max_variance_subset(values: list[float], m: int) -> list[int]:
    """Indices of the m values whose (population) variance is largest, in increasing index
    order; on a tie, the candidate with fewer low values."""
    n = len(values)
    if m >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (values[i], i))
    best, best_var = None, -1.0
    for low in range(m + 1):  # `low` lowest values and m - low highest
        pick = order[:low] + order[n - (m - low):]
        xs = [values[i] for i in pick]
        mean = sum(xs) / m
        var = sum((x - mean) ** 2 for x in xs) / m
        if var > best_var + 1e-12:
            best, best_var = pick, var
    return sorted(best)


def sample_keep(advantages: torch.Tensor, group_index: torch.Tensor, share: float) -> torch.Tensor:
    """(N,) bool: each group's max-variance subset of max(2, round(share n)) samples."""
    keep = torch.zeros(len(advantages), dtype=torch.bool)
    for g in torch.unique(group_index):
        rows = (group_index == g).nonzero().squeeze(-1).tolist()
        m = min(len(rows), max(2, round(share * len(rows))))
        chosen = max_variance_subset([float(advantages[i]) for i in rows], m)
        keep[[rows[j] for j in chosen]] = True
    return keep


def token_keep(token_adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
               share: float) -> torch.Tensor:
    """(B, T) float 0/1: of the tokens in `mask`, the round(share x count) with the largest
    |A| H (the earlier token first on a tie); the rest of the mask is 0."""
    live = mask > 0
    count = int(live.sum())
    k = round(share * count)
    out = torch.zeros_like(mask)
    if k <= 0:
        return out
    score = (token_adv.abs() * entropy).masked_fill(~live, float("-inf")).flatten()
    # a stable descending sort: ties keep their position order
    top = torch.sort(score, descending=True, stable=True).indices[:k]
    out.view(-1)[top] = 1.0
    return out
