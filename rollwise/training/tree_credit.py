"""TRACE's credit (docs/methods.md#trace): advantages among the sibling continuations of one
turn prefix, and per-turn advantages from a whole tree of episodes and their continuations
(train.advantage=trace and trace_tree, rollwise.training.advantages).

    adv = sibling_advantages(rewards, anchors)      # GRPO among each anchor's siblings
    segs = tree_advantages(records)                 # per-turn credit from the whole tree
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field


def mean_of(values: list[float]) -> float:
    """The mean, exactly the value when every value is the same (a float sum of six 0.3s
    divided by six misses 0.3 by an ulp, which would give a group of equal rewards a signal)."""
    return values[0] if all(v == values[0] for v in values) else sum(values) / len(values)


def sibling_advantages(rewards: list[float], anchors: list[Hashable]) -> list[float]:
    """Each continuation's reward minus the mean over the continuations of its anchor."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for r, a in zip(rewards, anchors):
        groups[a].append(r)
    return [r - mean_of(groups[a]) for r, a in zip(rewards, anchors)]


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
            values[node] = mean_of(vs)
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
