"""TRACE's turn-level prefix allocation (docs/methods.md#trace): continuations go to the turn
prefixes (anchors: a prompt root or an episode cut after one of its turns) most likely to give
mixed terminal rewards, judged by a predictor of success from the prefix's history. The credit
among sibling continuations is the trainer's (rollwise.training.tree_credit).

    counts = allocate(predicted_success, budget)   # continuations per anchor
"""

from __future__ import annotations

import torch


def mixed_probability(p: float, n: int) -> float:
    """P(n continuations with success probability p do not all agree)."""
    return 0.0 if n < 2 else 1.0 - p ** n - (1.0 - p) ** n


def allocate(success: list[float], budget: float, min_siblings: int = 2,
             max_per_anchor: int | None = None, costs: list[float] | None = None) -> list[int]:
    """Continuations per anchor, given each anchor's predicted success, within `budget`:
    continuations, or with `costs` (each anchor's expected sampled tokens per continuation)
    tokens. Greedy on the expected number of mixed sibling sets per unit of budget: an
    anchor's first share is `min_siblings` continuations (one alone is never mixed), ranked by
    p(1-p) per cost; each further one goes where it raises P(mixed) most per cost. Anchors
    predicted certain (p = 0 or 1) get nothing while any other gains."""
    costs = costs or [1.0] * len(success)
    counts = [0] * len(success)
    left = budget
    while True:
        best, gain, take = None, 0.0, 0
        for i, p in enumerate(success):
            n = counts[i]
            step = min_siblings if n == 0 else 1
            if step * costs[i] > left or (max_per_anchor and n + step > max_per_anchor):
                continue
            g = (mixed_probability(p, n + step) - mixed_probability(p, n)) / (step * costs[i])
            if best is None or g > gain:
                best, gain, take = i, g, step
        if best is None or gain <= 0:
            break
        counts[best] += take
        left -= take * costs[best]
    return counts


class PrefixPredictor:
    """Online logistic regression of terminal success on a prefix's features (the
    environment's description of its history: turn index, tool results so far, ...)."""

    def __init__(self, n_features: int, lr: float = 0.1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.zeros(n_features + 1)
        self.w[:-1] = 0.01 * torch.randn(n_features, generator=g)
        self.lr = lr

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        x = torch.cat([features, torch.ones(features.shape[0], 1)], dim=1)
        return torch.sigmoid(x @ self.w)

    def update(self, features: torch.Tensor, success: torch.Tensor, steps: int = 20) -> float:
        """Gradient steps on the log-loss; returns the last loss."""
        x = torch.cat([features, torch.ones(features.shape[0], 1)], dim=1)
        y = success.float()
        loss = 0.0
        for _ in range(steps):
            p = torch.sigmoid(x @ self.w).clamp(1e-6, 1 - 1e-6)
            self.w -= self.lr * x.T @ (p - y) / len(y)
            loss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
        return loss
