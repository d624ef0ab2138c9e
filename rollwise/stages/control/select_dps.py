"""DPS: Dynamics-Predictive Sampling (docs/methods.md#dps; maoyixiu/DPS recipe/dps/task_sampler.py).

Each prompt's solving progress is a 3-state hidden Markov chain: 0 unsolved, 1 partially
solved, 2 solved. A group's success rate s is observed as state 0 (s = 0), 2 (s = 1) or 1.
The transition matrix has Dirichlet counts alpha (3x3, column j = "from state j"), so
P = alpha / column sums is column-stochastic.

Observed with state o (previous posterior pi_prev, a one-hot after any observation):
    U = normalize(outer(e_o, pi_prev) * P)          soft count of the transition into o
    alpha <- d * alpha + (1 - d) * alpha_prior + U
    pi <- P(alpha) e_o                              belief for the next step
Not selected in a step:
    alpha <- d * alpha + (1 - d) * alpha_prior,  pi <- P(alpha) pi
so uncertainty grows while a prompt is unseen. Selection draws a candidate pool of
candidate_ratio * n prompts and takes the n with the highest predicted P(partially solved).

Unobserved updates are applied lazily (a prompt catches up on the steps it missed when it is
next looked at); tests check this equals updating every prompt every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from rollwise.stages.control.base import Selector
from rollwise.types import Problem

UNSOLVED, PARTIAL, SOLVED = 0, 1, 2


# maoyixiu/DPS task_sampler.py hmm_prior_alpha (column j: from state j). "stability" says a
# prompt tends to stay in its state, so one observation moves its prediction further (P(partial)
# 0.6 after a mixed group, against 0.4 with the flat prior).
STRUCTURED_PRIORS = {
    "progress": [[1.0, 0.5, 0.5], [1.0, 1.0, 0.5], [1.0, 1.0, 1.0]],
    "stability": [[1.0, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 1.0]],
    "local": [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
}


def observed_state(successes: int, trials: int) -> int:
    return UNSOLVED if successes == 0 else SOLVED if successes == trials else PARTIAL


def column_normalize(alpha: np.ndarray) -> np.ndarray:
    return alpha / alpha.sum(axis=0, keepdims=True)


@dataclass
class PromptHMM:
    alpha: np.ndarray
    belief: np.ndarray  # predicted state distribution for the next step
    posterior: np.ndarray  # pi_prev: last posterior (one-hot after an observation)
    step: int = 0  # the last step whose update has been applied
    seen: int = 0

    def unobserved(self, prior: np.ndarray, decay: float) -> None:
        self.alpha = decay * self.alpha + (1 - decay) * prior
        self.belief = column_normalize(self.alpha) @ self.belief

    def observe(self, state: int, prior: np.ndarray, decay: float) -> None:
        e = np.zeros(3)
        e[state] = 1.0
        u = np.outer(e, self.posterior) * column_normalize(self.alpha)
        # a jump the prior rules out (the "local" prior's unsolved <-> solved) has likelihood
        # 0: it was seen all the same, so count it from the posterior alone
        u = u / u.sum() if u.sum() > 0 else np.outer(e, self.posterior)
        self.alpha = decay * self.alpha + (1 - decay) * prior + u
        self.belief = column_normalize(self.alpha) @ e
        self.posterior = e
        self.seen += 1


@dataclass
class DPSSelector(Selector):
    decay: float = 1.0
    candidate_ratio: float = 4.0
    prior_count: float = 1.0
    entropy_weight: float = 0.0  # > 0: score P(partial) + w * H(belief) ("topk+entropy")
    prior_name: str = "flat"  # flat (prior_count everywhere) or a structured prior below
    prompts: dict[str, PromptHMM] = field(default_factory=dict)
    step: int = 0

    @classmethod
    def build(cls, cfg) -> "DPSSelector":
        c = cfg.control.dps
        return cls(decay=c.decay, candidate_ratio=c.candidate_ratio, prior_name=c.prior)

    @property
    def prior(self) -> np.ndarray:
        if self.prior_name == "flat":
            return np.full((3, 3), self.prior_count)
        if self.prior_name not in STRUCTURED_PRIORS:
            raise ValueError(f"control.dps.prior = {self.prior_name!r}: choose flat, "
                             f"{', '.join(STRUCTURED_PRIORS)}")
        return np.array(STRUCTURED_PRIORS[self.prior_name])

    def hmm(self, pid: str) -> PromptHMM:
        """The prompt's state, brought up to date with the steps it was not observed in."""
        h = self.prompts.get(pid)
        if h is None:
            uniform = np.full(3, 1 / 3)
            h = self.prompts[pid] = PromptHMM(self.prior.copy(), uniform, uniform.copy(),
                                              self.step)
        while h.step < self.step:
            h.unobserved(self.prior, self.decay)
            h.step += 1
        return h

    def score(self, pid: str) -> float:
        b = self.hmm(pid).belief
        s = float(b[PARTIAL])
        if self.entropy_weight:
            s += self.entropy_weight * float(-(b * np.log(np.clip(b, 1e-12, 1))).sum())
        return s

    def select(self, pool: list[Problem], n: int, rng: random.Random) -> list[Problem]:
        k = min(len(pool), max(n, int(round(self.candidate_ratio * n))))
        candidates = rng.sample(pool, k)
        ranked = sorted(range(k), key=lambda i: (-self.score(candidates[i].id), i))
        return [candidates[i] for i in ranked[:n]]

    def observe(self, outcomes: dict[str, tuple[int, int]], step: int) -> None:
        """outcomes: prompt id -> (successes, trials) of its group at `step`."""
        self.step = step - 1
        for pid, (succ, trials) in outcomes.items():
            self.hmm(pid).observe(observed_state(succ, trials), self.prior, self.decay)
            self.prompts[pid].step = step
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step, "prompts": {
            pid: {"alpha": h.alpha.tolist(), "belief": h.belief.tolist(),
                  "posterior": h.posterior.tolist(), "step": h.step, "seen": h.seen}
            for pid, h in self.prompts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.prompts = {pid: PromptHMM(np.array(d["alpha"]), np.array(d["belief"]),
                                       np.array(d["posterior"]), d["step"], d["seen"])
                        for pid, d in state["prompts"].items()}
