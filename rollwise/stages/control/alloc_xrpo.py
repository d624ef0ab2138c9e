"""XRPO's rollout allocator (Bamba et al. 2025, "XRPO: Pushing the limits of GRPO with
Targeted Exploration and Exploitation"; docs/methods.md#xrpo) as a GroupSizer:
control.group_size = xrpo.

Every selected prompt first gets control.xrpo.base rollouts. The rest of the step's budget,
(generate.group_size - base) per prompt, is then given one rollout at a time to the prompt of
highest priority

    Pi_q = Delta_q + phi_q
    Delta_q = h_q(n_q) - h_q(n_q + 1),  h_q(n) = t_{1 - alpha/2, n - 1} s_q / sqrt(n)
    phi_q = lam sqrt(log(1 + T) / n_q)

where h_q is the half-width of the t-interval on the prompt's mean reward (s_q the sample
standard deviation of its first rewards), so Delta_q is how much one more rollout would
shrink it, and phi_q is a UCB bonus for prompts given fewer rollouts, T the rollouts handed out
so far this step. Each prompt holds at most control.xrpo.max. The extra rollouts are generated
in one more round and merged into their groups before the advantages (as DARS's are).
rollwise's reading where the sources are silent: T counts this step's rollouts, and a group's
s_q is the unbiased sample standard deviation (0 for a group with equal rewards, which then
gets extra rollouts from the bonus alone).
"""

from __future__ import annotations

import functools
import math
import statistics

from rollwise.errors import ConfigError
from rollwise.stages.control.group_size import GroupSizer


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom, by bisection on its CDF
    (Simpson's rule on the density; no SciPy needed for a handful of df per run)."""
    if df < 1 or not 0.5 <= p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 <= p < 1, got df={df}, p={p}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf_above_zero(x: float, steps: int = 4000) -> float:  # P(0 < T < x)
        h = x / steps
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df))
             for i in range(steps + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while 0.5 + cdf_above_zero(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 + cdf_above_zero(mid) < p else (lo, mid)
    return (lo + hi) / 2


def half_width(n: int, s: float, alpha: float) -> float:
    """h(n): the half-width of the (1 - alpha) t-interval on a mean of n rewards with sample
    standard deviation s (infinite with a single reward)."""
    return math.inf if n < 2 else t_quantile(1 - alpha / 2, n - 1) * s / math.sqrt(n)


def priority(n: int, s: float, handed_out: int, alpha: float, lam: float) -> float:
    """Pi = Delta + phi for a prompt holding n rollouts, handed_out rollouts given so far."""
    shrink = half_width(n, s, alpha) - half_width(n + 1, s, alpha) if n >= 2 else math.inf
    return shrink + lam * math.sqrt(math.log(1 + handed_out) / n)


def allocate(stats: list[tuple[int, float]], budget: int, n_max: int, alpha: float,
             lam: float) -> list[int]:
    """Extra rollouts per prompt, given (rollouts so far, reward std) each and the budget:
    one at a time to the highest priority (the first prompt on a tie), every priority
    recomputed with the new count T."""
    extra = [0] * len(stats)
    handed = sum(n for n, _ in stats)
    for _ in range(budget):
        best, best_p = None, -math.inf
        for i, (n, s) in enumerate(stats):
            if n + extra[i] < n_max:
                p = priority(n + extra[i], s, handed, alpha, lam)
                if p > best_p:
                    best, best_p = i, p
        if best is None:
            break
        extra[best] += 1
        handed += 1
    return extra


class XRPO(GroupSizer):
    def __init__(self, cfg):
        c = cfg.control.xrpo
        self.n, self.base = cfg.generate.group_size, c.base
        self.n_max = c.max or 2 * self.n
        if not self.base <= self.n <= self.n_max:
            raise ConfigError(f"control.xrpo needs base <= generate.group_size <= max, got "
                              f"{self.base}, {self.n}, {self.n_max}: each prompt's share of the "
                              "step's budget is group_size")
        self.alpha, self.lam = c.alpha, c.bonus
        self.last: dict[str, float] = {}

    def sizes(self, problems, step):
        return [self.base] * len(problems)

    def extra(self, groups):
        stats = [(len(g.samples), statistics.stdev(g.rewards) if len(g.rewards) > 1 else 0.0)
                 for g in groups]
        out = allocate(stats, (self.n - self.base) * len(groups), self.n_max, self.alpha,
                       self.lam)
        totals = [n + e for (n, _), e in zip(stats, out)]
        self.last = {"control/xrpo/group_min": float(min(totals, default=0)),
                     "control/xrpo/group_max": float(max(totals, default=0)),
                     "control/xrpo/extra_to_equal_rewards": float(sum(
                         e for (_, s), e in zip(stats, out) if s == 0))}
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self.last)
