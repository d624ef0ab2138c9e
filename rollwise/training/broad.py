"""BroRL's broadened rollouts on the training side ("BroRL: Scaling Reinforcement Learning via
Broadened Exploration"; docs/methods.md#brorl): many rollouts per prompt, of which the update
trains an unbiased sub-sample (train.subsample = k), and the probability-mass balance that
says what an update did to correct and wrong responses (train.mass_balance).

Sub-sampling: each group's advantages are computed from all its n rollouts; then k of them,
drawn uniformly without replacement (seeded by the run's seed and the policy version), are
trained, each weighing n / k, and the n - k left out stay in the loss's denominators. Every
rollout is kept with probability k / n, so the expected update equals the whole group's
(tests/training/test_broad.py averages every subset).

Mass balance: before the update (the old log-probabilities) and after it (one more no-grad
pass), the mean probability of each response's own tokens, for correct and wrong responses,
split by whether the update trained the response (sampled) or left it out (unsampled: BroRL's
question is whether mass moves onto correct answers the update never saw).
"""

from __future__ import annotations

import torch


def subsample_rows(group_index: torch.Tensor, k: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep (N,) bool, weight (N,)): k rows of each group drawn uniformly without
    replacement (all of a group of k or fewer), each weighing n / k."""
    keep = torch.zeros(len(group_index), dtype=torch.bool)
    weight = torch.ones(len(group_index))
    for g in torch.unique(group_index):
        rows = (group_index == g).nonzero().squeeze(-1)
        n = len(rows)
        if n <= k:
            keep[rows] = True
            continue
        chosen = rows[torch.randperm(n, generator=generator)[:k]]
        keep[chosen] = True
        weight[chosen] = n / k
    return keep, weight


def mass_balance(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor,
                 correct: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """Mean probability of the responses' own tokens before and after an update, per class
    (correct / wrong) and per kind (sampled: trained by it; unsampled: left out). before and
    after are (B, T) log-probabilities, mask (B, T) the response tokens, correct and trained
    (B,) bool. A class with no token is left out."""
    out: dict[str, float] = {}
    for kind, rows in (("sampled", trained), ("unsampled", ~trained)):
        for name, cls in (("correct", correct), ("wrong", ~correct)):
            sel = mask * (rows & cls).float()[:, None]
            n = float(sel.sum())
            if n == 0:
                continue
            p0 = float((before.exp() * sel).sum()) / n
            p1 = float((after.exp() * sel).sum()) / n
            out[f"mass/{kind}_{name}_before"] = p0
            out[f"mass/{kind}_{name}_delta"] = p1 - p0
    return out
