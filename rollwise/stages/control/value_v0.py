"""V0, a value at state zero ("V_0: A Generalist Value Model for Any Policy at State Zero";
docs/methods.md#v0): the current policy's success rate on a prompt, predicted before any
rollout of it from a history of (prompt, observed success) pairs, with no gradient update of
its own. control.group_size = v0 spends the step's rollouts by it.

The paper's predictor is a trained model that reads the history in context. rollwise's reading
keeps the idea (the policy's capability enters only through its recent history) with a
predictor that needs no training: a kernel estimate over the history,

    p(x) = (k m + sum_j w_j s_j) / (k + sum_j w_j n_j)
    w_j  = exp((cos(x, x_j) - 1) / bandwidth) decay^(step - step_j)

where (x_j, s_j successes of n_j) are the last `history` groups, cos the cosine of the prompts'
hashed character n-grams (prompt_features.py), m the history's recency-weighted success rate
and k = prior_strength pseudo-counts of it. A prompt seen before is close to its own past
groups; an unseen one borrows from the prompts that read like it.

Allocation: n_i in proportion to p_i (1 - p_i) (the Bernoulli variance: the expected spread of
the group's rewards), at least control.v0.min, at most control.v0.max, generate.group_size
per prompt on average. Calibration: each step, the predictions made before generation are
scored against the outcomes (Brier score per rollout, AUC of the prediction between solved
and failed rollouts; the Brier score of predicting m for every prompt beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.errors import ConfigError
from rollwise.stages.control.group_size import GroupSizer, proportional_sizes
from rollwise.stages.control.prompt_features import features, prompt_text
from rollwise.types import Group


@dataclass
class Record:
    text: str
    successes: int
    trials: int
    step: int


class V0Predictor:
    """Success-rate predictions for prompts from a history of observed groups."""

    def __init__(self, history: int = 1024, bandwidth: float = 0.1, decay: float = 0.9,
                 prior_strength: float = 2.0, dim: int = 1024):
        self.size, self.bandwidth, self.decay = history, bandwidth, decay
        self.prior_strength, self.dim = prior_strength, dim
        self.records: list[Record] = []
        self._feats = torch.zeros((0, dim))

    def observe(self, records: list[Record]) -> None:
        """Add groups to the history; the oldest beyond `history` are forgotten."""
        self.records = (self.records + list(records))[-self.size:]
        new = features([r.text for r in records], self.dim) if records else None
        feats = self._feats if new is None else torch.cat([self._feats, new])
        self._feats = feats[-self.size:]

    def base_rate(self, step: int) -> float:
        """m: the history's success rate, recency-weighted (0.5 with no history)."""
        if not self.records:
            return 0.5
        r = self._recency(step)
        s = torch.tensor([x.successes for x in self.records], dtype=torch.float64)
        n = torch.tensor([x.trials for x in self.records], dtype=torch.float64)
        return float((r * s).sum() / (r * n).sum().clamp_min(1e-12))

    def predict(self, texts: list[str], step: int) -> list[float]:
        m = self.base_rate(step)
        if not self.records or not texts:
            return [m] * len(texts)
        cos = features(texts, self.dim).double() @ self._feats.double().T
        w = torch.exp((cos - 1) / self.bandwidth) * self._recency(step)
        s = torch.tensor([x.successes for x in self.records], dtype=torch.float64)
        n = torch.tensor([x.trials for x in self.records], dtype=torch.float64)
        k = self.prior_strength
        return ((k * m + w @ s) / (k + w @ n)).tolist()

    def _recency(self, step: int) -> torch.Tensor:
        return torch.tensor([self.decay ** max(step - x.step, 0) for x in self.records],
                            dtype=torch.float64)

    def state_dict(self) -> dict:
        return {"records": [[r.text, r.successes, r.trials, r.step] for r in self.records]}

    def load_state_dict(self, state: dict) -> None:
        self.records, self._feats = [], torch.zeros((0, self.dim))
        self.observe([Record(*r) for r in state["records"]])


def brier(predicted: list[float], outcomes: list[int]) -> float:
    """Mean squared error of predicted probabilities against 0/1 outcomes."""
    return sum((p - y) ** 2 for p, y in zip(predicted, outcomes)) / max(len(outcomes), 1)


def auc(predicted: list[float], outcomes: list[int]) -> float | None:
    """Probability that a solved rollout's prediction exceeds a failed one's (ties count
    half), by ranks (Mann-Whitney U); None without both kinds."""
    pos = sum(outcomes)
    neg = len(outcomes) - pos
    if pos == 0 or neg == 0:
        return None
    order = sorted(range(len(predicted)), key=lambda i: predicted[i])
    ranks = [0.0] * len(predicted)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and predicted[order[j + 1]] == predicted[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, outcomes) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def route(predicted: dict[str, float], costs: dict[str, float], cost_weight: float) -> str:
    """V0 as a router: of the candidate models, the one with the largest predicted success
    minus cost_weight x its cost (the first on a tie)."""
    missing = set(predicted) - set(costs)
    if missing:
        raise ValueError(f"route: no cost for {sorted(missing)}")
    return max(predicted, key=lambda m: predicted[m] - cost_weight * costs[m])


class V0(GroupSizer):
    """control.group_size = v0."""

    def __init__(self, cfg):
        c = cfg.control.v0
        self.n = cfg.generate.group_size
        self.n_min, self.n_max = c.min, c.max or 2 * self.n
        if not self.n_min <= self.n <= self.n_max:
            raise ConfigError(f"control.v0 needs min <= generate.group_size <= max, got "
                              f"{self.n_min}, {self.n}, {self.n_max}")
        self.predictor = V0Predictor(c.history, c.bandwidth, c.decay, c.prior_strength)
        self.pending: dict[str, float] = {}  # prompt id -> prediction made before generation
        self.base = 0.5
        self.last: dict[str, float] = {}

    def sizes(self, problems, step):
        preds = self.predictor.predict([prompt_text(p.prompt) for p in problems], step)
        self.base = self.predictor.base_rate(step)
        self.pending.update({p.id: q for p, q in zip(problems, preds)})
        sizes = proportional_sizes([q * (1 - q) for q in preds], self.n * len(problems),
                                   self.n_min, self.n_max)
        self.last = {"control/v0/predicted_mean": sum(preds) / max(len(preds), 1),
                     "control/v0/group_min": float(min(sizes, default=0)),
                     "control/v0/group_max": float(max(sizes, default=0))}
        return sizes

    def observe(self, scored: list[Group], step: int) -> None:
        preds, ys = [], []
        for g in scored:
            if g.prompt_id in self.pending:
                q = self.pending[g.prompt_id]
                outcome = [int(r >= 1.0) for r in g.rewards]
                preds += [q] * len(outcome)
                ys += outcome
        if ys:
            self.last["control/v0/brier"] = brier(preds, ys)
            self.last["control/v0/brier_const"] = brier([self.base] * len(ys), ys)
            a = auc(preds, ys)
            if a is not None:
                self.last["control/v0/auc"] = a
        self.pending = {}
        self.predictor.observe([Record(prompt_text(g.problem.prompt),
                                       sum(r >= 1.0 for r in g.rewards), len(g.samples), step)
                                for g in scored if g.samples and g.problem is not None])

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"predictor": self.predictor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.predictor.load_state_dict(state["predictor"])
