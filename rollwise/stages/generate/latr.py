"""LATR, lookahead tree rollouts (generate.strategy=latr; docs/methods.md#latr, rules in
tree_rules.py).

Per prompt, a share η(step) of the group comes from a tree, the rest are i.i.d. samples. The
tree starts from one greedy root; at every token, where the second-best token of the unwarped
distribution is likely (p2 > tau_abs) and close to the best (p1 - p2 < tau_rel), a child
branches on it (chosen, not sampled: Sample.chosen), while the tree has fewer live branches
than its share. A child born r steps ago (r in `ages`) whose newest r tokens are within
`similarity` normalised edit distance of its parent's is pruned: it rejoined its parent's path.
The tree phase ends when the branch count reaches the exit count and every branch is older
than max(ages), or at `force_exit`; each branch then continues by sampling at the round's
settings (no re-prefill), and a tree short of its share is filled with i.i.d. samples. Greedy
tree tokens are marked chosen too; train.chosen_tokens decides how the loss treats them.

A tree's state lasts one round: a branch an in-flight controller pauses (APRIL) resumes next
round as a plain sampled sequence, and its group keeps the branches it had.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.generate.tree_rules import (
    eta_at,
    latr_branches,
    latr_exit_count,
    latr_too_similar,
)
from rollwise.types import Group, Problem, Sample


@dataclass
class _Tree:
    group: Group
    problem: Problem
    size: int  # branches wanted (η of the group)
    live: set = field(default_factory=set)  # uids of branches still generating
    members: dict = field(default_factory=dict)  # uid -> Sample, pruned ones removed
    checks: list = field(default_factory=list)  # (child, parent, r) lookahead comparisons
    exiting: bool = False
    switched: set = field(default_factory=set)  # uids continuing by sampling


class LatrGenerator(Generator):
    def __init__(self, cfg, tokenizer):
        self.group_size, self.cfg = cfg.generate.group_size, cfg.generate.latr
        self.max_len = cfg.generate.max_new_tokens
        self._trees: dict[str, _Tree] = {}  # root uid -> tree

    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        eta = eta_at(self.cfg.eta, step)
        tree_params = dataclasses.replace(rollout.params, temperature=0.0, top_logprobs=2,
                                          event_every=1)
        self._trees, self._step = {}, step
        for p in problems:
            G = p.group_size or self.group_size
            n_tree = round(eta * G)
            group = Group(p.id, [new_sample(p, p.prompt_ids, step) for _ in range(G - n_tree)], p)
            rollout.add(group)
            if n_tree:
                root = new_sample(p, p.prompt_ids, step)
                tree = self._trees[root.uid] = _Tree(group, p, n_tree)
                tree.members[root.uid] = root
                tree.live.add(root.uid)
                rollout.extend(group, [root], tree_params)
        rollout.run(self._on_event)

    def _on_event(self, ev, s: Sample, rollout: Rollout):
        tree = self._trees.get(s.root_uid or s.uid)
        if tree is None or s.uid not in tree.members:
            return None  # an i.i.d. sample, or one carried from an earlier round
        if s.uid not in tree.switched:  # greedy: chosen, not sampled (a child's branch token
            # is marked already)
            s.chosen += range(s.chosen[-1] + 1 if s.chosen else 0, s.num_tokens)
        if ev.finished:
            tree.live.discard(s.uid)
        self._lookahead(tree, rollout)
        if s.uid in tree.members and not ev.finished:
            if tree.exiting:
                if s.uid not in tree.switched:
                    tree.switched.add(s.uid)
                    rollout.switch_params(s, rollout.params)
            else:
                self._maybe_branch(tree, ev, s, rollout)
                self._maybe_exit(tree, s.num_tokens, rollout)
        if not tree.live:
            self._fill(tree, rollout)
        return None

    def _maybe_branch(self, tree: _Tree, ev, s: Sample, rollout: Rollout) -> None:
        if len(tree.members) >= tree.size or not ev.top_logprobs:
            return
        top = sorted(ev.top_logprobs[-1], key=lambda x: -x[1])
        if len(top) < 2:
            return
        (_, lp1), (t2, lp2) = top[0], top[1]
        if latr_branches(math.exp(lp1), math.exp(lp2), self.cfg.tau_abs, self.cfg.tau_rel):
            child, = rollout.fork(s, 1, "latr_branch", tokens=[t2])
            tree.members[child.uid] = child
            tree.live.add(child.uid)
            tree.checks += [(child, s, r) for r in self.cfg.ages]

    def _lookahead(self, tree: _Tree, rollout: Rollout) -> None:
        """Compare each child with its parent once both have r tokens past the branch; skip a
        pair where either ended first or the parent is gone."""
        keep = []
        for child, parent, r in tree.checks:
            if child.uid not in tree.members or parent.uid not in tree.members:
                continue
            b = child.branch_point
            ended = [x for x in (child, parent) if x.uid not in tree.live]
            if any(x.num_tokens < b + r for x in ended):
                continue  # one ended before the comparison point: no check
            if min(child.num_tokens, parent.num_tokens) < b + r:
                keep.append((child, parent, r))
                continue
            if latr_too_similar(child.response_ids[b:b + r], parent.response_ids[b:b + r],
                                self.cfg.similarity):
                del tree.members[child.uid]
                tree.live.discard(child.uid)
                rollout.discard(child, "latr_similar")
        tree.checks = keep

    def _maybe_exit(self, tree: _Tree, t: int, rollout: Rollout) -> None:
        oldest = max(self.cfg.ages)
        young = any(m.branch_point is not None and t - m.branch_point < oldest
                    for m in tree.members.values())
        if t >= self.cfg.force_exit or (
                len(tree.members) >= latr_exit_count(tree.size, 1, t, self.max_len)
                and not young):
            tree.exiting = True
            tree.checks = []
            self._fill(tree, rollout)

    def _fill(self, tree: _Tree, rollout: Rollout) -> None:
        """I.i.d. samples for the branches the tree did not grow (once)."""
        missing = tree.size - len(tree.members)
        if missing > 0:
            fresh = [new_sample(tree.problem, tree.problem.prompt_ids, self._step)
                     for _ in range(missing)]
            for f in fresh:
                f.meta["tree_fill"] = True
            tree.size = len(tree.members)  # filled: never again
            rollout.extend(tree.group, fresh)
