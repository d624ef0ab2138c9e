"""Filter stage: turn finished responses into named reward channels, each with its reason.

    stage = build_filter(cfg.filter, task)               # verifiers by name, weighted
    metrics = stage.score(samples, problems, texts)      # fills sample.rewards/reward/...

Verifiers (rollwise.stages.filter.<module>): exact and task (exact.py), math and gym
(math_verifier.py), code in a sandbox (code_verifier.py, sandbox.py), format and length
(fmt.py), judge (judge.py), majority vote (majority.py), user functions (user.py); the
protocol is in base.py, the worker pool in pool.py. See docs/filter.md.

`make_scorer(name, task)` and `eval_scorer(cfg, task)` give a per-sample scorer
score(response, problem) -> (reward, info) for held-out evaluation, which always compares
with the true answer (a majority-vote, judge, format or length reward evaluates as exact) and
runs an isolated verifier with the same timeout as training (HeldOutScorer).
"""

from __future__ import annotations

import time
from collections import Counter

from rollwise.config import FilterConfig
from rollwise.stages.filter.base import Item, Verdict, Verifier
from rollwise.stages.filter.stage import (
    CORRECTNESS,
    Channel,
    FilterStage,
    build_filter,
    make_verifier,
    weights_of,
)
from rollwise.stages.filter.user import import_object
from rollwise.tasks import Task
from rollwise.tasks.extract import make_extractor
from rollwise.types import Problem, Scorer

__all__ = ["Item", "Verdict", "Verifier", "FilterStage", "build_filter", "make_scorer",
           "eval_scorer", "import_object", "Scorer", "HeldOutScorer"]


class HeldOutScorer:
    """score(response, problem) -> (reward, info) against the true answer, for evaluation, and
    score_all for a whole evaluation at once. Its verifier runs as in training: an isolated
    one (a user function, math-verify, code) in filter.workers worker processes, each sample
    cut off after filter.timeout_s (a hang is a failure, never a hung run); with
    filter.workers=0, or a function a worker process cannot import (defined in __main__ or a
    notebook), in this process with no time limit. `start(seconds)` bounds the scoring of
    what follows as a whole (one evaluation), from its first answer scored on: past it,
    samples fail with cause 'deadline' unscored. Generation before it does not count, however
    long the answers take to write. Failures are counted by cause in `failures`. close() ends
    the workers."""

    def __init__(self, stage: FilterStage):
        self.stage = stage
        self.budget: float | None = None
        self.deadline: float | None = None
        self.failures: Counter[str] = Counter()
        self.scoring = (0, 0)  # (scored, to score) of the latest score_all: progress notes

    def start(self, seconds: float | None) -> None:
        """What is scored from now on must be scored within `seconds` of the first scoring
        (None: no bound)."""
        self.budget, self.deadline = seconds or None, None

    def _clock(self) -> float | None:
        if self.budget is not None and self.deadline is None:
            self.deadline = time.monotonic() + self.budget
        return self.deadline

    def score_all(self, responses: list[str], problems: list[Problem], on_progress=None
                  ) -> list[tuple[float, str, str | None]]:
        """(reward, info, failure cause or None) per response; a failed one's reward is 0."""
        items = [Item(r, p) for r, p in zip(responses, problems)]
        self.scoring = (0, len(items))

        def progress(done: int, total: int) -> None:
            self.scoring = (done, total)
            if on_progress is not None:
                on_progress(done, total)
        out = []
        for verdicts in self.stage.verdicts(items, self._clock(), progress):
            _, reward, info, cause = self.stage.combine(verdicts)
            if cause:
                self.failures[cause] += 1
            out.append((0.0 if cause else reward, info, cause))
        self.scoring = (len(items), len(items))
        return out

    def __call__(self, response: str, problem: Problem) -> tuple[float, str]:
        ((reward, info, cause),) = self.score_all([response], [problem])
        if cause:
            raise RuntimeError(f"scoring failed ({cause}): {info}")
        return reward, info

    def close(self) -> None:
        self.stage.close()


def make_scorer(name: str, task: Task, cfg=None) -> HeldOutScorer:
    """The held-out scorer of verifier `name` (cfg: FilterConfig, for its workers and
    timeout). Names that carry no ground truth (majority, judge, format, length) score as
    'exact'."""
    cfg = cfg or FilterConfig()
    if name not in CORRECTNESS and ":" not in name:
        name = "exact"
    verifier = make_verifier(name, cfg, task)
    verifier.name = name.rsplit(":", 1)[-1] if ":" in name else name
    return HeldOutScorer(FilterStage([Channel(verifier.name, 1.0, verifier)],
                                     _extractor(cfg, task), cfg.workers, cfg.timeout_s))


def eval_scorer(cfg, task: Task) -> HeldOutScorer:
    """The scorer held-out pass@1 should use for a training config (cfg: FilterConfig): its
    first ground-truth verifier (exact, math, gym, code or a user function), else exact."""
    names = list(weights_of(cfg.reward))
    truth = [n for n in names if n in CORRECTNESS or ":" in n]
    return make_scorer(truth[0] if truth else "exact", task, cfg)


def _extractor(cfg, task):
    return make_extractor(cfg.extract, task)
