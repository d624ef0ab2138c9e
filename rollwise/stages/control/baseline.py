"""A baseline for each rollout that needs no group (control.baseline): what a single-rollout
method (MSSR, train.advantage = mssr) subtracts from the reward.

Before a step's rewards are learned, every scored sample gets meta["baseline"], the value
expected for its prompt from earlier steps only:

    running   (k m + sum_j d^age_j r_j) / (k + sum_j d^age_j) over the prompt's own earlier
              rewards r_j (decay d = control.baseline_decay per step), with m the run's
              recency-weighted mean reward held as k = control.baseline_prior pseudo-counts,
              so a prompt never seen gets m;
    v0        V0's prediction from the history of similar prompts (value_v0.py, control.v0.*).

Then the step's rewards join the statistics. Rewards are read as they are (not thresholded), so
the baseline is a mean reward, as the advantage needs.
"""

from __future__ import annotations

from rollwise.stages.control.prompt_features import prompt_text
from rollwise.stages.control.value_v0 import Record, V0Predictor
from rollwise.types import Group


class Baseline:
    def __init__(self, cfg):
        c = cfg.control
        self.mode, self.decay, self.prior = c.baseline, c.baseline_decay, c.baseline_prior
        v = c.v0
        self.v0 = V0Predictor(v.history, v.bandwidth, v.decay, v.prior_strength) \
            if self.mode == "v0" else None
        self.prompts: dict[str, list[float]] = {}  # prompt id -> [weighted sum, weight, step]
        self.total = [0.0, 0.0, 0]  # the run's: [weighted sum, weight, step]
        self.last: dict[str, float] = {}

    def _decayed(self, entry: list[float], step: int) -> tuple[float, float]:
        k = self.decay ** max(step - entry[2], 0)
        return entry[0] * k, entry[1] * k

    def value(self, pid: str, step: int) -> float:
        """running: the prompt's baseline at `step` from what was learned before it."""
        s_all, w_all = self._decayed(self.total, step)
        m = s_all / w_all if w_all > 0 else 0.5
        s, w = self._decayed(self.prompts.get(pid, [0.0, 0.0, step]), step)
        return (self.prior * m + s) / (self.prior + w)

    def annotate(self, scored: list[Group], step: int) -> None:
        """Each sample's baseline from earlier steps; then this step's rewards are learned."""
        texts = [prompt_text(g.problem.prompt) if g.problem else "" for g in scored]
        values = self.v0.predict(texts, step) if self.v0 is not None else \
            [self.value(g.prompt_id, step) for g in scored]
        for g, b in zip(scored, values):
            for s in g.samples:
                s.meta["baseline"] = b
        if self.v0 is not None:  # one batched prediction above; the history learns now
            self.v0.observe([Record(t, sum(g.rewards), len(g.samples), step)
                             for g, t in zip(scored, texts)])
        else:
            for g in scored:
                self._learn(g, step)
        self.last = {"control/baseline/mean": sum(values) / len(values)} if values else {}

    def _learn(self, g: Group, step: int) -> None:
        for entry in (self.prompts.setdefault(g.prompt_id, [0.0, 0.0, step]), self.total):
            s, w = self._decayed(entry, step)
            entry[:] = [s + sum(g.rewards), w + len(g.samples), step]

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"prompts": {k: list(v) for k, v in self.prompts.items()},
                "total": list(self.total),
                "v0": self.v0.state_dict() if self.v0 is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.prompts = {k: list(v) for k, v in state["prompts"].items()}
        self.total = list(state["total"])
        if self.v0 is not None and state.get("v0"):
            self.v0.load_state_dict(state["v0"])
