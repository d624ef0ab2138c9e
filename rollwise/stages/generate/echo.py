"""ECHO, entropy-confidence tree rollouts (generate.strategy=echo; docs/methods.md#echo, rules in
tree_rules.py). With filter.reward=majority it is test-time RL on trees.

Per prompt, `echo.roots` sampled sequences report their top-k log-probabilities at every
token. A sequence branches once, at its first token t >= min_position where the top-k entropy
is high, the group confidence low and the entropy rising: w children (the width rule) continue
from its prefix, each on one of the top-w tokens other than the one it sampled (chosen, not
sampled: Sample.chosen). Children may branch again later. While the group is short of its size
the tree grows; a sequence whose confidence collapses (the three prune rules) is cut and
dropped, its tokens counted as pruned. Once no tree sequence is left generating, the group is
filled to its size: with i.i.d. samples, or (fill = dora) with continuations of the tree's
finished sequences' openings, spread over the openings by DORA's direction-level rule
(dora_fill; rollwise/search.py has the rule and its reading).

A tree's state lasts one round: a branch an in-flight controller pauses (APRIL) resumes next
round as a plain sampled sequence, and its group keeps the branches it had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rollwise.search import allocation_weights, direction_ids, split_budget
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.generate.tree_rules import (
    EchoTrace,
    echo_alternatives,
    echo_branches_at,
    echo_prune_reason,
    echo_push,
    echo_width,
)
from rollwise.types import Group, Problem, Sample


@dataclass
class _Tree:
    group: Group
    problem: Problem
    size: int
    live: set = field(default_factory=set)  # uids of tree sequences still generating
    traces: dict = field(default_factory=dict)  # uid -> EchoTrace
    branched: set = field(default_factory=set)  # uids that took their branch
    filled: bool = False


class EchoGenerator(Generator):
    def __init__(self, cfg, tokenizer):
        self.group_size, self.cfg = cfg.generate.group_size, cfg.generate.echo
        self._trees: dict[str, _Tree] = {}

    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        params = dataclasses.replace(rollout.params, top_logprobs=self.cfg.top_k, event_every=1)
        self._trees, self._step = {}, step
        for p in problems:
            G = p.group_size or self.group_size
            roots = [new_sample(p, p.prompt_ids, step) for _ in range(min(self.cfg.roots, G))]
            group = Group(p.id, roots, p)
            tree = _Tree(group, p, G)
            for r in roots:
                self._trees[r.uid] = tree
                tree.traces[r.uid] = EchoTrace()
                tree.live.add(r.uid)
            rollout.add(group, params)
        rollout.run(self._on_event)

    def _on_event(self, ev, s: Sample, rollout: Rollout):
        tree = self._trees.get(s.root_uid or s.uid)
        trace = tree.traces.get(s.uid) if tree is not None else None
        if trace is None:
            return None  # an i.i.d. fill sample, or one carried from an earlier round
        for top in ev.top_logprobs or []:
            echo_push(trace, [lp for _, lp in top], self.cfg)
        if ev.finished:
            tree.live.discard(s.uid)
        elif self.cfg.prune and (why := echo_prune_reason(trace, self.cfg)):
            tree.live.discard(s.uid)
            rollout.discard(s, f"echo_{why}")
        else:
            self._maybe_branch(tree, trace, ev, s, rollout)
        if not tree.live:
            self._fill(tree, rollout)
        return None

    def _maybe_branch(self, tree: _Tree, trace: EchoTrace, ev, s: Sample,
                      rollout: Rollout) -> None:
        t = len(trace.H) - 1
        room = tree.size - len(tree.group.samples)
        if s.uid in tree.branched or room <= 0 or not echo_branches_at(trace, t, self.cfg):
            return
        tree.branched.add(s.uid)
        width = min(echo_width(trace.H[t], trace.Cg[t], self.cfg), room)
        alternatives = echo_alternatives(ev.top_logprobs[-1], ev.token_ids[-1], width)
        if not alternatives:
            return
        for child in rollout.fork(s, len(alternatives), "echo_branch", tokens=alternatives):
            tree.traces[child.uid] = trace.head(t)  # its next event brings token t
            tree.live.add(child.uid)

    def _fill(self, tree: _Tree, rollout: Rollout) -> None:
        if tree.filled:
            return
        tree.filled = True
        missing = tree.size - len(tree.group.samples)
        if missing <= 0:
            return
        fresh = dora_fill(tree.group.samples, missing, self.cfg.fill_prefix_tokens,
                          self.cfg.fill_temperature) if self.cfg.fill == "dora" else []
        fresh += [new_sample(tree.problem, tree.problem.prompt_ids, self._step)
                  for _ in range(missing - len(fresh))]
        for f in fresh:
            f.meta["tree_fill"] = "dora" if f.parent_uid else True
        rollout.extend(tree.group, fresh)


def dora_fill(samples: list[Sample], missing: int, k: int, temperature: float) -> list[Sample]:
    """`missing` continuations of the finished sequences' first k response tokens, each
    opening (a direction) getting its share by DORA's rule over the sequences' mean token
    log-probabilities; none when no sequence is longer than its opening. A continuation is a
    child of the sequence it continues, branching at k, its copied tokens trained as the
    parent's are."""
    cands = [s for s in samples if len(s.response_ids) > k]
    if not cands:
        return []
    quality = [sum(s.logprobs) / len(s.logprobs) for s in cands]
    dirs = direction_ids([tuple(s.response_ids[:k]) for s in cands])
    counts = split_budget(allocation_weights(quality, dirs, temperature, "dora"), missing)
    return [_opening(s, k) for s, n in zip(cands, counts) for _ in range(n)]


def _opening(parent: Sample, k: int) -> Sample:
    child = parent.fork()
    for name in ("response_ids", "logprobs", "versions", "loss_mask", "entropies"):
        del getattr(child, name)[k:]
    child.chosen = [i for i in child.chosen if i < k]
    child.branch_point = k
    return child

