"""TRACE rollouts (docs/methods.md#trace; generate.strategy=trace over an episode environment): a
problem's sampling budget (its group size in episodes) is spent first on generate.trace.roots
episodes from the prompt, then on continuations of the turn prefixes most likely to give mixed
terminal rewards.

1. Roots: `roots` episodes per problem, played to the end.
2. Anchors: the prompt of each problem, and each root episode cut after each model turn and
   the environment's answer to it. A shared predictor (rollwise.agents.trace.PrefixPredictor)
   estimates each anchor's success from its history: its depth, the tool calls and the error
   observations so far.
3. The rest of the budget goes out greedily by the gain in P(mixed sibling set) per sampled
   token (rollwise.agents.trace.allocate: p(1-p) per cost first, two continuations at least
   per anchor). The budget (generate.trace.budget=tokens) is the sampled tokens root-only
   allocation would spend on the problems' further episodes, at the mean of their roots; a
   continuation costs what its root sampled after the cut. budget=episodes counts
   continuations instead, however short.
   A continuation of a cut starts from the root's tokens up to the cut (held in its prompt:
   only its own turns are trained) and an environment brought to that point by replaying the
   root's actions, so environments must be deterministic in the actions they are given.
4. Siblings: every sample carries meta['trace_anchor']; train.advantage=trace takes each
   reward minus the mean over its anchor's samples (roots and the prompt's continuations
   share the prompt's anchor). A root also carries meta['trace_cuts'], its cuts' response
   offsets and anchor keys, from which train.advantage=trace_tree credits each of its turns
   apart (rollwise.agents.trace.tree_advantages). The predictor learns from every outcome.

The round's ledger counts anchors, continuations by depth and mixed sibling sets
(decisions/trace/...).
"""

from __future__ import annotations

import torch

from rollwise.agents.episode import Episode, EpisodeGenerator
from rollwise.agents.trace import PrefixPredictor, allocate
from rollwise.stages.generate.group import new_sample

N_FEATURES = 4


def won(e: Episode) -> float:
    """1 when the episode earned a reward of 1 or more without an environment error."""
    return float(e.sample.meta.get("env_reward", 0.0) >= 1.0 and "env_error" not in e.sample.meta)


def features(depth: int, max_turns: int, info: dict, errors: int) -> list[float]:
    """An anchor's history: at the prompt, depth in turns, tool calls so far, errors seen."""
    calls = float(info.get("tool_calls", 0))
    return [float(depth == 0), depth / max_turns, min(calls, 3.0) / 3.0, min(errors, 3) / 3.0]


class TraceGenerator(EpisodeGenerator):
    def __init__(self, cfg, tokenizer, seed: int | None = None):
        super().__init__(cfg, tokenizer, seed)
        t = cfg.generate.trace
        if t.roots >= self.group_size:
            raise ValueError(f"generate.trace.roots = {t.roots} leaves nothing of "
                             f"generate.group_size = {self.group_size} to allocate: set fewer "
                             "roots than the group size")
        self.roots, self.allocate_all = t.roots, t.allocation == "trace"
        self.token_budget = t.budget == "tokens"
        self.predictor = PrefixPredictor(N_FEATURES, lr=t.predictor_lr, seed=cfg.run.seed)

    def generate(self, rollout, problems, step: int) -> None:
        roots = self.begin(rollout, problems, step, n=self.roots)
        self.play(rollout)
        anchors = self._anchors(roots)
        counts = self._allocation(anchors)
        continued = []
        for anchor, n in zip(anchors, counts):
            for _ in range(n):
                e = self._branch(anchor, step)
                if e is not None:
                    continued.append((anchor, e))
                    rollout.extend(e.group, [e.sample])
        self.play(rollout)
        self._learn(roots, continued)

    def _anchors(self, roots: list[Episode]) -> list[dict]:
        """The prompt of each problem, then every cut of every unsplit root episode."""
        out, seen = [], set()
        sampled: dict[str, list[int]] = {}  # problem id -> its roots' sampled tokens
        for e in roots:
            sampled.setdefault(e.group.problem.id, []).append(
                sum(sum(s.loss_mask) for s in (*e.pieces, e.sample)))
        for e in roots:
            if e.group.problem.id not in seen:
                seen.add(e.group.problem.id)
                mean = sum(sampled[e.group.problem.id]) / len(sampled[e.group.problem.id])
                out.append(dict(key=f"{e.group.problem.id}@0", depth=0, root=e, cost=mean,
                                x=features(0, self.max_turns, {}, 0)))
            e.sample.meta["trace_anchor"] = f"{e.group.problem.id}@0"
            if e.pieces or "env_error" in e.sample.meta:
                continue
            errors, cuts = 0, []
            e.sample.meta["trace_cuts"] = cuts
            for depth, (tokens, n_messages, info) in enumerate(e.cuts, start=1):
                errors += str(e.messages[n_messages - 1]["content"]).startswith("error")
                key = f"{e.sample.uid}@{depth}"
                cuts.append([tokens, key])  # for train.advantage=trace_tree
                out.append(dict(key=key, depth=depth, root=e,
                                tokens=tokens, messages=n_messages,
                                cost=sum(e.sample.loss_mask[tokens:]),
                                x=features(depth, self.max_turns, info, errors)))
        self.ledger.decide("trace", "anchor", "count", len(out))
        return out

    def _allocation(self, anchors: list[dict]) -> list[int]:
        """Continuations per anchor: each problem's group size less its roots, shared over
        the batch by TRACE's greedy allocation (in sampled tokens or in episodes), or
        (allocation=root) each problem's own from its prompt, as i.i.d. groups would."""
        if not anchors:
            return []
        left = [(a["root"].group.problem.group_size or self.group_size) - self.roots
                if a["depth"] == 0 else 0 for a in anchors]  # one prompt anchor per problem
        if not self.allocate_all:
            return left
        p = self.predictor.predict(torch.tensor([a["x"] for a in anchors])).tolist()
        if not self.token_budget:
            return allocate(p, sum(left), min_siblings=2)
        costs = [max(1.0, a["cost"]) for a in anchors]  # a continuation samples 1 token at least
        return allocate(p, sum(n * c for n, c in zip(left, costs)), min_siblings=2, costs=costs)

    def _branch(self, anchor: dict, step: int) -> Episode | None:
        """A new episode from the anchor: a fresh one at the prompt; at a cut, the root's
        tokens so far as its prompt and the environment replayed to the same point."""
        root, group = anchor["root"], anchor["root"].group
        if anchor["depth"] == 0:
            e = self._start(group.problem, group, step, join=False)
        else:
            s = new_sample(group.problem, root.sample.prompt_ids
                           + root.sample.response_ids[:anchor["tokens"]], step)
            messages = root.messages[:anchor["messages"]]
            e = Episode(s, None, group, list(messages), turns=anchor["depth"],
                        offset=anchor["tokens"])
            s.meta.update(turn_start=0, turn_budget=min(
                self.turn_tokens, self.episode_tokens - anchor["tokens"]), env_reward=0.0)
            try:
                e.env = self.make_env(group.problem)
                e.env.reset(group.problem)
                for m in messages:
                    if m["role"] == "assistant":
                        s.meta["env_reward"] += float(e.env.step(m["content"])[1])
            except Exception as ex:  # an environment that cannot be replayed: no branch
                self.ledger.decide("trace", "replay", "failed")
                s.meta["replay_error"] = f"{type(ex).__name__}: {ex}"
                return None
        e.sample.meta.update(trace_anchor=anchor["key"], trace_depth=anchor["depth"])
        if not e.done:  # a fresh episode whose environment failed to start has ended
            self.live[e.sample.uid] = e
        self.ledger.decide("trace", "continue", f"depth{anchor['depth']}")
        return e

    def _learn(self, roots: list[Episode], continued: list[tuple[dict, Episode]]) -> None:
        """Count mixed sibling sets; fit the predictor to every outcome from an anchor."""
        sets: dict[str, list[float]] = {}
        xs, ys = [], []
        for e in roots:
            sets.setdefault(e.sample.meta["trace_anchor"], []).append(won(e))
            xs.append(features(0, self.max_turns, {}, 0))
            ys.append(won(e))
        for anchor, e in continued:
            sets.setdefault(anchor["key"], []).append(won(e))
            xs.append(anchor["x"])
            ys.append(won(e))
        for outcomes in sets.values():
            if len(outcomes) > 1:
                self.ledger.decide("trace", "siblings", "sets")
                if 0 < sum(outcomes) < len(outcomes):
                    self.ledger.decide("trace", "siblings", "mixed")
        if xs:
            self.predictor.update(torch.tensor(xs), torch.tensor(ys))
