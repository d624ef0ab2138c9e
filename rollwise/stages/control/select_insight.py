"""InSight: prompt selection by weighted mutual information ("Efficient RLVR Training via
Weighted Mutual Information Data Selection", 2025).

Each prompt keeps a Beta(a, b) posterior on its success rate theta (successes and failures of
its groups, decayed toward the prior by `decay` per observation, as MoPPS). A prompt's score is

    w(p) * I(Y_1..k ; theta),    p = a / (a + b), the mean belief,

with I the mutual information between the number of successes Y of its next k rollouts and
theta: I = H(Y) - E_theta[H(Y | theta)], Y ~ BetaBinomial(k, a, b), in closed form (digamma
terms, no sampling). It is the evidence term: what one more group would teach about theta; it
shrinks as a prompt is observed. w(p) = 4 p (1 - p) is the difficulty term: a group on a
prompt near p = 0.5 has mixed rewards, one near 0 or 1 gives GRPO nothing. Scored on the mean
belief, not on a sampled theta, so selection is deterministic up to ties (broken by the step's
random stream). rollwise's reading: the paper's abstract names the two terms and the mean
belief; the form of w is rollwise's.
"""

from __future__ import annotations

import math
import random

from rollwise.stages.control.base import Selector
from rollwise.types import Problem


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def _digamma(x: float) -> float:
    """psi(x) for x > 0: the recurrence up to 6, then the asymptotic series."""
    out = 0.0
    while x < 6:
        out -= 1 / x
        x += 1
    f = 1 / (x * x)
    return out + math.log(x) - 0.5 / x - f * (1 / 12 - f * (1 / 120 - f * (1 / 252 - f / 240)))


def mutual_information(a: float, b: float, k: int) -> float:
    """I(Y; theta) in nats for theta ~ Beta(a, b) and Y | theta ~ Binomial(k, theta)."""
    h_y, h_given = 0.0, 0.0
    psi_n = _digamma(a + b + k)
    for y in range(k + 1):
        log_choose = math.lgamma(k + 1) - math.lgamma(y + 1) - math.lgamma(k - y + 1)
        p_y = math.exp(log_choose + _log_beta(a + y, b + k - y) - _log_beta(a, b))
        h_y -= p_y * math.log(p_y) if p_y > 0 else 0.0
        # E_theta[P(y|theta) log P(y|theta)] = P(y) E_{Beta(a+y, b+k-y)}[log P(y|theta)]
        e_log = (log_choose + y * (_digamma(a + y) - psi_n)
                 + (k - y) * (_digamma(b + k - y) - psi_n))
        h_given -= p_y * e_log
    return max(h_y - h_given, 0.0)


def score(a: float, b: float, k: int) -> float:
    """Difficulty term times evidence term, at the mean belief."""
    p = a / (a + b)
    return 4 * p * (1 - p) * mutual_information(a, b, k)


class InsightSelector(Selector):
    @classmethod
    def build(cls, cfg) -> "InsightSelector":
        c = cfg.control.insight
        return cls(k=c.k or cfg.generate.group_size, decay=c.decay, prior=c.prior)

    def __init__(self, k: int = 8, decay: float = 1.0, prior: tuple[float, float] = (1.0, 1.0)):
        self.k, self.decay, self.prior = k, decay, tuple(prior)
        self.counts: dict[str, list[float]] = {}  # prompt id -> [a, b]
        self.last: dict[str, float] = {}

    def posterior(self, pid: str) -> tuple[float, float]:
        a, b = self.counts.get(pid, self.prior)
        return a, b

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        memo: dict[tuple[float, float], float] = {}  # unseen prompts share one posterior
        scores = [memo.setdefault(post, score(*post, self.k))
                  for post in (self.posterior(p.id) for p in pool)]
        ties = [rng.random() for _ in pool]
        order = sorted(range(len(pool)), key=lambda i: (-scores[i], ties[i]))[:n]
        self.last = {"control/insight/score": sum(scores[i] for i in order) / max(len(order), 1)}
        return [pool[i] for i in order]

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        d, (a0, b0) = self.decay, self.prior
        for pid, (succ, trials) in outcomes.items():
            a, b = self.posterior(pid)
            self.counts[pid] = [d * a + (1 - d) * a0 + succ, d * b + (1 - d) * b0 + trials - succ]

    def metrics(self) -> dict[str, float]:
        """The last selection's mean score (difficulty times evidence, in nats)."""
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: list(v) for k, v in state["counts"].items()}
