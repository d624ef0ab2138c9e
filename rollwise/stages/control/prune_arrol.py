"""ARRoL (Xu et al. 2026, "Prune as You Generate: Online Rollout Pruning for Faster and Better
RLVR", arXiv 2603.24840; docs/methods.md#arrol) as an in-flight controller: control.inflight=arrol.

Control over-samples each group (G becomes ceil(G / kappa), `allocate`). When every sample of a
group has T_p response tokens (control.arrol.checkpoint) or has ended, a quality head scores
each one: q = sigmoid(w.h + b), h the policy's detached last hidden state at the prefix's last
token. The group keeps round(kappa n) survivors, the rho share with the highest q and the rest
with the lowest, so about rho of them succeed; the others are aborted at once (their KV slots
freed) and leave the group (a tree's parent is never pruned from under its children). A share
control.arrol.explore of groups is pruned at random
instead, so the head also sees an unselected sample. After scoring, the head learns from the
survivors' (h, final reward >= 1) by binary cross-entropy (a few Adam steps over the latest
examples); `metrics` gives its AUC on the step's survivors, measured before it learned from
them. The released code is a README only: the selection rule and the head's training
are rollwise's reading of the paper (docs/methods.md#arrol), and the survivors are a
biased sample by design.
"""

from __future__ import annotations

import math
import random

import torch

from rollwise.stages.control.inflight import CONTINUE, Decision, InflightController
from rollwise.types import Group

PRUNE = Decision("abort", "arrol_pruned")
MEMORY = 2048  # (h, label) examples the head trains on: the latest ones


class QualityHead:
    """Logistic regression on hidden states, trained online; its state is plain lists."""

    def __init__(self, lr: float):
        self.lr, self.linear, self.opt = lr, None, None
        self.memory: list[tuple[list[float], float]] = []

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """(n, d) -> (n,) success probabilities; 0.5 before it has learned anything."""
        if self.linear is None:
            return torch.full((h.shape[0],), 0.5)
        with torch.no_grad():
            return torch.sigmoid(self.linear(h).squeeze(-1))

    def learn(self, h: torch.Tensor, labels: torch.Tensor, steps: int = 25) -> None:
        self.memory = (self.memory + list(zip(h.tolist(), labels.tolist())))[-MEMORY:]
        if self.linear is None:
            self._build(h.shape[1])
        x = torch.tensor([m[0] for m in self.memory])
        y = torch.tensor([m[1] for m in self.memory])
        for _ in range(steps):
            self.opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                self.linear(x).squeeze(-1), y)
            loss.backward()
            self.opt.step()

    def _build(self, d: int) -> None:
        self.linear = torch.nn.Linear(d, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.opt = torch.optim.Adam(self.linear.parameters(), lr=self.lr)

    def state_dict(self) -> dict:
        if self.linear is None:
            return {"memory": []}
        return {"memory": self.memory, "linear": {k: v.tolist() for k, v in
                                                   self.linear.state_dict().items()},
                "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory = [tuple(m) for m in state["memory"]]
        if "linear" in state:
            lin = {k: torch.tensor(v) for k, v in state["linear"].items()}
            self._build(lin["weight"].shape[1])
            self.linear.load_state_dict(lin)
            self.opt.load_state_dict(state["opt"])


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a random positive outscores a random negative (ties count half);
    None without both classes."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def balanced_keep(q: list[float], keep: int, rho: float) -> list[int]:
    """Indices of the survivors: the round(rho keep) highest q and the rest lowest."""
    order = sorted(range(len(q)), key=lambda i: -q[i])
    top = round(rho * keep)
    return order[:top] + (order[len(q) - (keep - top):] if keep > top else [])


def hidden_states(policy, seqs: list[list[int]]) -> torch.Tensor:
    """The policy's last hidden state at each sequence's last token, (n, d) float, detached."""
    device = next(policy.parameters()).device
    n, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros((n, t), dtype=torch.long)
    mask = torch.zeros((n, t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        out = policy(input_ids=ids.to(device), attention_mask=mask.to(device),
                     output_hidden_states=True, use_cache=False)
    last = torch.tensor([len(s) - 1 for s in seqs])
    return out.hidden_states[-1][torch.arange(n), last.to(device)].float().cpu()


class Arrol(InflightController):
    def __init__(self, cfg=None):
        c = cfg.control.arrol
        self.t_p, self.kappa, self.rho, self.explore = (c.checkpoint, c.keep, c.rho,
                                                       c.explore)
        self.head = QualityHead(c.lr)
        self.seed = cfg.run.seed
        self.policy = None
        self._group_of: dict[str, Group] = {}
        self._decided: set[int] = set()  # id(group)
        self._pruned: set[str] = set()  # uids
        self._pending: dict[str, tuple[torch.Tensor, float]] = {}  # survivor -> (h, q)
        self._metrics: dict[str, float] = {}

    def bind(self, policy=None, **_) -> None:
        self.policy = policy

    def allocate(self, problems, sizes: list[int]) -> list[int]:
        return [math.ceil(n / self.kappa - 1e-9) for n in sizes]

    def begin(self, want: int, step: int):
        self._group_of, self._decided, self._pruned = {}, set(), set()
        return [], want

    def on_event(self, event, sample, rollout) -> Decision:
        group = self._group(sample, rollout)
        if id(group) in self._decided:
            return CONTINUE
        if all(s.finished or s.num_tokens >= self.t_p for s in group.samples):
            self._decide(group, rollout)  # aborts the pruned ones, this sample included
        return CONTINUE

    def _group(self, sample, rollout) -> Group:
        if sample.uid not in self._group_of:
            self._group_of = {s.uid: g for g in rollout.groups for s in g.samples}
        return self._group_of[sample.uid]

    def _decide(self, group: Group, rollout) -> None:
        self._decided.add(id(group))
        samples, n = group.samples, len(group.samples)
        keep = max(1, round(self.kappa * n))
        rng = random.Random(f"{self.seed}:{samples[0].group_id}")  # no state to checkpoint
        policy = self.policy if self.policy is not None else getattr(rollout.engine, "model", None)
        if policy is None:
            raise RuntimeError("control.inflight = arrol needs the policy's hidden states: "
                               "bind it (Control.bind(policy=model)) or use the builtin engine")
        h = hidden_states(policy, [s.prompt_ids + s.response_ids[:self.t_p] for s in samples])
        q = self.head.score(h).tolist()
        # a tree's parent stays: its children's lineage and shared prefix point to it
        parents = {s.parent_uid for s in samples}
        forced = [i for i in range(n) if samples[i].uid in parents]
        free = [i for i in range(n) if samples[i].uid not in parents]
        k = max(0, keep - len(forced))
        if k >= len(free):
            chosen = free
        elif self.head.linear is None or rng.random() < self.explore:
            chosen = rng.sample(free, k)
        else:
            chosen = [free[j] for j in balanced_keep([q[i] for i in free], k, self.rho)]
        survivors = forced + chosen
        for i in survivors:
            self._pending[samples[i].uid] = (h[i], q[i])
        for i in set(range(n)) - set(survivors):
            self._pruned.add(samples[i].uid)
            if not samples[i].finished:
                rollout.decide_for(samples[i], PRUNE)

    def q_weights(self, policy, draws: list[tuple[list[int], list[int]]]) -> list[float]:
        """The head's success probability of each (prompt ids, response ids) at the
        checkpoint: ARRoL's test-time weights (rollwise eval --vote q)."""
        if self.head.linear is None:
            raise RuntimeError("the ARRoL quality head has not learned anything yet: train "
                               "with control.inflight = arrol before voting with it")
        h = hidden_states(policy, [list(p) + list(r[:self.t_p]) for p, r in draws])
        return self.head.score(h).tolist()

    def end(self, rollout, want: int) -> list[Group]:
        pruned_tokens = 0
        for g in rollout.groups:
            gone = [s for s in g.samples if s.uid in self._pruned]
            pruned_tokens += sum(s.num_tokens for s in gone)
            g.samples = [s for s in g.samples if s.uid not in self._pruned]
        rollout.ledger.tokens_to("pruned/arrol", pruned_tokens)
        rollout.ledger.decide("control", "prune", "arrol", len(self._pruned))
        return [g for g in rollout.groups if g.samples]

    def observe(self, scored: list[Group], step: int) -> None:
        """The survivors' final rewards: the head's AUC on them, then it learns from them."""
        seen = [(s, *self._pending.pop(s.uid)) for g in scored for s in g.samples
                if s.uid in self._pending]
        self._pending.clear()  # survivors never scored (a plugin dropped them) are forgotten
        if not seen:
            self._metrics = {}
            return
        labels = [s.reward >= 1.0 for s, _, _ in seen]
        self._metrics = {"arrol/survivor_pos_share": sum(labels) / len(labels)}
        a = auc([q for _, _, q in seen], labels)
        if a is not None:
            self._metrics["arrol/head_auc"] = a
        self.head.learn(torch.stack([h for _, h, _ in seen]), torch.tensor(labels).float())

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
