"""VADE: variance-aware dynamic sampling (Hu et al. 2025, "VADE: Variance-Aware Dynamic
Sampling via Online Sample-Level Difficulty Estimation for Multimodal RL").

Each training prompt keeps a Beta posterior on its success rate, fed by the outcomes of its
groups (no extra rollouts). A step draws theta ~ Beta(a, b) for every prompt of the pool and
takes the n with the largest sampled reward variance theta (1 - theta): the prompts whose next
group is most likely to have mixed rewards, with exploration from the draw.

The policy moves, so old outcomes must fade. rollwise's reading of the paper's two-scale prior
decay (its exact formula was not available): the evidence (successes, failures) is kept twice,
decaying by `fast_decay` and by `slow_decay` per training step. The slow copy is the prompt's
prior: its mean success rate, carried as at most `prior_strength` pseudo-counts on top of the
base prior; the fast copy is the evidence on top of that. A prompt observed lately is
estimated from its recent groups (the fast copy dominates); one not drawn for a while falls
back to its long-run rate, held loosely enough that the draws still explore it, instead of
to the flat prior. Decay is by steps elapsed, also for prompts not drawn meanwhile.

Against control.selector=thompson (MoPPS): with target 0.5 both rank by the same quantity,
|theta - 0.5| being a decreasing function of theta (1 - theta). They differ in how evidence
fades: MoPPS decays a prompt's counts only when the prompt is observed again (one scale), so a
prompt not drawn for many steps keeps its old estimate; VADE decays every prompt by the steps
elapsed, on two scales.
"""

from __future__ import annotations

import random

from rollwise.stages.control.base import Selector
from rollwise.types import Problem


class VadeSelector(Selector):
    @classmethod
    def build(cls, cfg) -> "VadeSelector":
        c = cfg.control.vade
        return cls(c.fast_decay, c.slow_decay, c.prior_strength, c.prior)

    def __init__(self, fast_decay: float = 0.8, slow_decay: float = 0.98,
                 prior_strength: float = 4.0, prior: tuple[float, float] = (1.0, 1.0)):
        self.decays = (fast_decay, slow_decay)
        self.prior_strength, self.prior = prior_strength, tuple(prior)
        # prompt id -> [successes_fast, failures_fast, successes_slow, failures_slow, step]
        self.evidence: dict[str, list[float]] = {}
        self.step = 0
        self.last: dict[str, float] = {}

    def _decayed(self, pid: str) -> tuple[float, float, float, float]:
        sf, ff, ss, fs, seen = self.evidence.get(pid, (0.0, 0.0, 0.0, 0.0, self.step))
        kf, ks = (d ** (self.step - seen) for d in self.decays)
        return sf * kf, ff * kf, ss * ks, fs * ks

    def posterior(self, pid: str) -> tuple[float, float]:
        """Beta(a, b): the base prior, the slow copy's mean as up to prior_strength
        pseudo-counts, and the fast copy's evidence."""
        sf, ff, ss, fs = self._decayed(pid)
        slow = ss + fs
        held = min(slow, self.prior_strength)
        mean = ss / slow if slow > 0 else 0.5
        return (self.prior[0] + held * mean + sf, self.prior[1] + held * (1 - mean) + ff)

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        thetas = [rng.betavariate(*self.posterior(p.id)) for p in pool]
        order = sorted(range(len(pool)), key=lambda i: -thetas[i] * (1 - thetas[i]))[:n]
        self.last = {"control/vade/variance": _mean(thetas[i] * (1 - thetas[i]) for i in order),
                     "control/vade/mean_belief": _mean(_mean_of(self.posterior(pool[i].id))
                                                       for i in order)}
        return [pool[i] for i in order]

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """Every prompt's evidence decays to this step; then this step's groups are added."""
        self.step = step
        for pid, (succ, trials) in outcomes.items():
            sf, ff, ss, fs = self._decayed(pid)
            fail = trials - succ
            self.evidence[pid] = [sf + succ, ff + fail, ss + succ, fs + fail, step]

    def metrics(self) -> dict[str, float]:
        """The last selection: mean sampled variance theta (1 - theta) and mean posterior
        success rate of the prompts it took."""
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"evidence": {k: list(v) for k, v in self.evidence.items()}, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.evidence = {k: list(v) for k, v in state["evidence"].items()}
        self.step = state["step"]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _mean_of(beta: tuple[float, float]) -> float:
    return beta[0] / (beta[0] + beta[1])
