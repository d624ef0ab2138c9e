"""TRACE's turn-level prefix allocation (docs/methods.md#trace): continuations go to the turn
prefixes (anchors: a prompt root or an episode cut after one of its turns) most likely to give
mixed terminal rewards, judged by a predictor of success from the prefix's history, and
advantages are computed among the sibling continuations of one prefix.

    counts = allocate(predicted_success, budget)   # continuations per anchor
    adv = sibling_advantages(rewards, anchors)      # GRPO among each anchor's siblings
    segs = tree_advantages(records)                 # per-turn credit from the whole tree
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field

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


def sibling_advantages(rewards: list[float], anchors: list[Hashable]) -> list[float]:
    """Each continuation's reward minus the mean over the continuations of its anchor."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for r, a in zip(rewards, anchors):
        groups[a].append(r)
    return [r - sum(groups[a]) / len(groups[a]) for r, a in zip(rewards, anchors)]


@dataclass
class TreeRecord:
    """One sample of a TRACE tree: the anchor it was sampled from, its terminal reward, and
    for a root episode its cuts, (response offset where the next model turn starts, the cut's
    anchor key), in order."""

    anchor: Hashable
    reward: float
    cuts: list[tuple[int, Hashable]] = field(default_factory=list)


def tree_advantages(records: list[TreeRecord]) -> list[list[tuple[int, float]]]:
    """Per-turn advantages from a TRACE tree, as (first response token, advantage) segments.

    A node (the prompt or a cut) has branches: the samples continued from it, and the root's
    own way on, which reaches its next cut or its end. A node's value is the mean over its
    branches of the branch's value (the next cut's value, or the reward at a leaf): every
    branch of one node is an i.i.d. sample from that prefix, so the mean is unbiased, and a
    node with continuations below it is estimated from all of them. A turn's advantage is the
    value of the node it leads to less its baseline: the value of the last node at or before
    its start with two branches or more (a node with one branch has no siblings to compare).
    Along a root's path these telescope to its reward less the prompt's baseline, so with no
    continuations every turn gets GRPO's r - mean (no std); a continuation gets its reward
    less its anchor's value."""
    branches: dict[Hashable, list[tuple[str, object]]] = defaultdict(list)
    parent: dict[Hashable, Hashable] = {}
    for i, r in enumerate(records):
        path = [r.anchor] + [key for _, key in r.cuts]
        for up, down in zip(path, path[1:]):
            branches[up].append(("node", down))
            parent[down] = up
        branches[path[-1]].append(("leaf", i))
    values: dict[Hashable, float] = {}

    def value(node: Hashable) -> float:
        if node not in values:
            vs = [records[x].reward if kind == "leaf" else value(x)
                  for kind, x in branches[node]]
            values[node] = sum(vs) / len(vs)
        return values[node]

    def baseline(node: Hashable) -> float:
        while len(branches[node]) < 2 and node in parent:
            node = parent[node]
        return value(node)

    out = []
    for r in records:
        path = [r.anchor] + [key for _, key in r.cuts]
        starts = [0] + [offset for offset, _ in r.cuts]
        ends = [value(node) for node in path[1:]] + [r.reward]
        out.append([(start, q - baseline(node)) for start, q, node in zip(starts, ends, path)])
    return out


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
