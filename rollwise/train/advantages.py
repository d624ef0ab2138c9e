"""Advantage estimators: pure functions of per-sample rewards and group membership, chosen by
name through a small registry.

    fn(rewards (N,), group_index (N,) long) -> advantages (N,)
"""

from __future__ import annotations

from typing import Callable

import torch

ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn
    return wrap


def get_advantage(name: str) -> Callable[..., torch.Tensor]:
    if name not in ADVANTAGES:
        raise KeyError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


def group_stats(values: torch.Tensor, group_index: torch.Tensor):
    """Per-sample mean and (unbiased) std of the sample's group. values (N,) -> (N,), (N,)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=values.dtype).index_add_(0, inverse, values)
    mean = sums / counts
    sq = torch.zeros(len(counts), dtype=values.dtype).index_add_(
        0, inverse, (values - mean[inverse]) ** 2)
    std = (sq / (counts - 1).clamp_min(1)).sqrt()
    return mean[inverse], std[inverse]


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath eq. 3): A_i = (r_i - mean_g r) / (std_g r + eps),
    std unbiased as in TRL and verl. A group with equal rewards gets zeros."""
    mean, std = group_stats(rewards.float(), group_index)
    return (rewards - mean) / (std + eps)
