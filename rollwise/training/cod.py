"""Connect-the-Dots credit assignment (docs/methods.md#cod; Trinity-RFT's cod_advantage): a pack of
K related tasks is solved in one long rollout that alternates solve-task episodes with
update-context episodes (a new hint). Returns are rewards-to-go over the pack, baselines are
kept per (pack, episode type, index), and RED reweighting keeps the batch's token-weighted
advantage sum from going negative.

    solve, hint = reward_to_go(task_rewards, hint_rewards)
    adv = baseline_advantages(records)            # records: (key, return)
    adv = red_reweight(adv, token_counts)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable

from rollwise.training.tree_credit import mean_of


def reward_to_go(task_rewards: list[float], hint_rewards: list[float]
                 ) -> tuple[list[float], list[float]]:
    """Solve episode i: the mean of task rewards i..K-1. Hint j (written after task j): the
    mean of [its own reward, task rewards j+1..K-1]."""
    k = len(task_rewards)
    if len(hint_rewards) > k:
        raise ValueError(f"{len(hint_rewards)} hints for {k} tasks: a hint follows a task")
    solve = [sum(task_rewards[i:]) / (k - i) for i in range(k)]
    hint = [(h + sum(task_rewards[j + 1:])) / (1 + k - j - 1)
            for j, h in enumerate(hint_rewards)]
    return solve, hint


def baseline_advantages(records: list[tuple[Hashable, float]]) -> list[float]:
    """Each return minus the mean return of the records with the same key, (pack, episode
    type, index): the repeats of one slot of one pack. No std normalization."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for key, ret in records:
        groups[key].append(ret)
    means = {k: mean_of(v) for k, v in groups.items()}
    return [ret - means[key] for key, ret in records]


def red_reweight(advantages: list[float], token_counts: list[int], t_low: float = 0.8,
                 t_high: float = 100.0, iterations: int = 50) -> tuple[list[float], float | None]:
    """RED: when the token-weighted sum of advantages is negative, scale each advantage by
    exp(A / T), with the largest T in [t_low, t_high] (bisection) that brings the sum to >= 0
    (t_low when none does). Returns (advantages, T or None when no reweighting was needed)."""
    def weighted(t: float | None) -> float:
        return sum(n * a * (math.exp(a / t) if t else 1.0)
                   for a, n in zip(advantages, token_counts))
    if weighted(None) >= 0:
        return list(advantages), None
    if weighted(t_low) < 0:
        t = t_low
    elif weighted(t_high) >= 0:
        t = t_high
    else:  # the sum falls as T grows: keep weighted(lo) >= 0 > weighted(hi)
        lo, hi = t_low, t_high
        for _ in range(iterations):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if weighted(mid) >= 0 else (lo, mid)
        t = lo
    return [a * math.exp(a / t) for a in advantages], t
