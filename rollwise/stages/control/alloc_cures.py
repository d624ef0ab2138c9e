"""CurES ("CurES: From Gradient Analysis to Efficient Curriculum Learning for Reasoning
LLMs"; docs/methods.md#cures): which prompts (control.selector = cures) and how many rollouts
each (control.group_size = cures).

Both read a prompt's success rate from a Beta(1, 1) posterior on its counts,
p = (successes + 1) / (trials + 2).

Selection: prompts are drawn without replacement with probability proportional to
exp(sqrt(p (1 - p)) / temperature). The public code divides by 100 (successes + 1), which
makes the weights differ by less than 0.5 % (uniform sampling in effect); rollwise reads the
temperature as the constant of the paper's formula, control.cures.temperature.

Allocation: the step's budget (generate.group_size per prompt) is split in proportion to

    sigma^2 = p q^2 E[g_c^2] + p^2 q E[g_w^2] - p^2 q^2 (E[g_c] - E[g_w])^2,   q = 1 - p

where g is the norm of the gradient of log pi(y) over the embedding parameters, for the
prompt's correct (g_c) and wrong (g_w) responses. rollwise measures g after each step on up to
control.cures.grad_samples responses per group, with the policy the loop binds, as the norm of
the gradient with respect to the input-embedding rows the sequence uses (for a model with tied
input and output embeddings the output side is left out). A prompt's latest group gives its
moments; a prompt not measured yet, or a class it has no response of, takes the mean over the
prompts measured. With control.cures.gradient = none every g is 1 and sigma = sqrt(p q).
"""

from __future__ import annotations

import math
import random

import torch

from rollwise.errors import ConfigError
from rollwise.stages.control.base import Selector
from rollwise.stages.control.group_size import GroupSizer, proportional_sizes
from rollwise.types import Group, Problem

_NO_POLICY = ("control.cures.gradient = embedding measures gradients with the policy, which this "
              "run does not give the Control stage (asynchronous training reads the engine's "
              "weights): set control.cures.gradient = none")


def posterior_rate(successes: float, trials: float) -> float:
    return (successes + 1) / (trials + 2)


def cures_sigma(p: float, g_correct: list[float], g_wrong: list[float]) -> float:
    """sqrt of CurES's gradient-variance term for success rate p and the gradient norms of
    correct and wrong responses (equal norms g give g sqrt(p q))."""
    q = 1 - p
    mc, mw = _mean(g_correct), _mean(g_wrong)
    mc2, mw2 = _mean([g * g for g in g_correct]), _mean([g * g for g in g_wrong])
    var = p * q * q * mc2 + p * p * q * mw2 - p * p * q * q * (mc - mw) ** 2
    return math.sqrt(max(var, 0.0))


def embedding_grad_norms(policy, seqs: list[tuple[list[int], list[int]]],
                         batch: int = 8) -> list[float]:
    """For each (prompt ids, response ids): the norm of the gradient of the response's log
    probability with respect to the input-embedding matrix (one row per vocabulary entry,
    summed over the positions that use it). One backward pass per micro-batch of sequences,
    to the embedding outputs only; no parameter gradient is kept."""
    device = next(policy.parameters()).device
    embed = policy.get_input_embeddings()
    out: list[float] = []
    for k in range(0, len(seqs), batch):
        chunk = seqs[k:k + batch]
        t = max(len(p) + len(r) for p, r in chunk)
        ids = torch.zeros((len(chunk), t), dtype=torch.long)
        mask = torch.zeros((len(chunk), t), dtype=torch.long)
        for i, (p, r) in enumerate(chunk):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            mask[i, :len(p) + len(r)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.enable_grad():
            x = embed(ids).detach().requires_grad_(True)
            logits = policy(inputs_embeds=x, attention_mask=mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            total = logits.new_zeros((), dtype=torch.float32)
            for i, (p, r) in enumerate(chunk):
                pos = torch.arange(len(p) - 1, len(p) + len(r) - 1, device=device)
                total = total + logp[i, pos, ids[i, pos + 1]].sum()
            (grad,) = torch.autograd.grad(total, x)
        for i, (p, r) in enumerate(chunk):
            n = len(p) + len(r)
            used, row_of = torch.unique(ids[i, :n], return_inverse=True)
            rows = grad.new_zeros((len(used), grad.shape[-1]), dtype=torch.float32)
            rows.index_add_(0, row_of, grad[i, :n].float())
            out.append(float(rows.norm()))
    return out


class CuresSelector(Selector):
    """control.selector = cures: softmax over sqrt(p (1 - p)) / temperature, without
    replacement."""

    @classmethod
    def build(cls, cfg) -> "CuresSelector":
        return cls(cfg.control.cures.temperature)

    def __init__(self, temperature: float = 0.1):
        self.temperature = temperature
        self.counts: dict[str, list[int]] = {}  # prompt id -> [successes, trials]
        self.last: dict[str, float] = {}

    def weights(self, pool: list[Problem]) -> list[float]:
        rates = [posterior_rate(*self.counts.get(p.id, (0, 0))) for p in pool]
        logits = [math.sqrt(r * (1 - r)) / self.temperature for r in rates]
        top = max(logits, default=0.0)
        return [math.exp(x - top) for x in logits]

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        w = self.weights(pool)
        # weighted sampling without replacement: keys u^(1/w), the n largest (Efraimidis-Spirakis)
        keys = [rng.random() ** (1 / wi) if wi > 0 else 0.0 for wi in w]
        order = sorted(range(len(pool)), key=lambda i: -keys[i])[:n]
        rates = [posterior_rate(*self.counts.get(pool[i].id, (0, 0))) for i in order]
        self.last = {"control/cures/mean_rate": _mean(rates),
                     "control/cures/max_weight_share": max(w, default=0) / max(sum(w), 1e-12)}
        return [pool[i] for i in order]

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        for pid, (succ, trials) in outcomes.items():
            c = self.counts.setdefault(pid, [0, 0])
            c[0] += succ
            c[1] += trials

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: list(v) for k, v in state["counts"].items()}


class Cures(GroupSizer):
    """control.group_size = cures: n_i proportional to sigma_i, in [min, max], summing to
    generate.group_size per selected prompt."""

    def __init__(self, cfg):
        c = cfg.control.cures
        self.n = cfg.generate.group_size
        self.n_min, self.n_max = c.min, c.max or 2 * self.n
        if not self.n_min <= self.n <= self.n_max:
            raise ConfigError(f"control.cures needs min <= generate.group_size <= max, got "
                              f"{self.n_min}, {self.n}, {self.n_max}")
        self.gradient, self.grad_samples = c.gradient, c.grad_samples
        self.policy = None
        self.counts: dict[str, list[int]] = {}  # prompt id -> [successes, trials]
        self.norms: dict[str, list[list[float]]] = {}  # prompt id -> [g_correct, g_wrong]
        self.last: dict[str, float] = {}

    def bind(self, **context) -> None:
        if "policy" not in context:
            return
        self.policy = context["policy"]
        if self.policy is None and self.gradient == "embedding":
            raise ConfigError(_NO_POLICY)

    def sigmas(self, problems: list[Problem]) -> list[float]:
        known = list(self.norms.values())
        pooled = ([g for c, _ in known for g in c] or [1.0],
                  [g for _, w in known for g in w] or [1.0])
        out = []
        for p in problems:
            rate = posterior_rate(*self.counts.get(p.id, (0, 0)))
            gc, gw = self.norms.get(p.id, ([], []))
            out.append(cures_sigma(rate, gc or pooled[0], gw or pooled[1]))
        return out

    def sizes(self, problems, step):
        sig = self.sigmas(problems)
        sizes = proportional_sizes(sig, self.n * len(problems), self.n_min, self.n_max)
        self.last = {"control/cures/group_min": float(min(sizes, default=0)),
                     "control/cures/group_max": float(max(sizes, default=0)),
                     "control/cures/sigma_mean": _mean(sig)}
        return sizes

    def observe(self, scored: list[Group], step: int) -> None:
        for g in scored:
            c = self.counts.setdefault(g.prompt_id, [0, 0])
            c[0] += sum(r >= 1.0 for r in g.rewards)
            c[1] += len(g.samples)
        if self.gradient == "embedding":
            self._measure(scored)

    def _measure(self, scored: list[Group]) -> None:
        if self.policy is None:
            raise ConfigError(_NO_POLICY)
        picked = [(g.prompt_id, s) for g in scored for s in g.samples[:self.grad_samples]
                  if s.response_ids]
        norms = embedding_grad_norms(self.policy, [(s.prompt_ids, s.response_ids)
                                                   for _, s in picked])
        fresh: dict[str, list[list[float]]] = {}
        for (pid, s), g in zip(picked, norms):
            fresh.setdefault(pid, [[], []])[0 if s.reward >= 1.0 else 1].append(g)
        self.norms.update(fresh)
        if norms:
            self.last["control/cures/grad_norm_mean"] = _mean(norms)

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()},
                "norms": {k: [list(c), list(w)] for k, (c, w) in self.norms.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: list(v) for k, v in state["counts"].items()}
        self.norms = {k: [list(c), list(w)] for k, (c, w) in state["norms"].items()}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
