"""Filter stage: turn finished responses into named reward channels, each with its reason.

    stage = build_filter(cfg.filter, task)               # verifiers by name, weighted
    metrics = stage.score(samples, problems, texts)      # fills sample.rewards/reward/...

Verifiers (rollwise.stages.filter.<module>): exact and task (exact.py), math and gym
(math_verifier.py), code in a sandbox (code_verifier.py, sandbox.py), format and length
(fmt.py), judge (judge.py), majority vote (majority.py), user functions (user.py); the
protocol is in base.py, the worker pool in pool.py. See docs/filter.md.

`make_scorer(name, task)` and `eval_scorer(cfg, task)` give a per-sample scorer
score(response, problem) -> (reward, info) for held-out evaluation, which always compares
with the true answer (a majority-vote, judge, format or length reward evaluates as exact).
"""

from __future__ import annotations

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
           "eval_scorer", "import_object", "Scorer"]


def make_scorer(name: str, task: Task, cfg=None) -> Scorer:
    """Per-sample scorer for evaluation: verifier `name` against the true answer, in-process.
    Names that carry no ground truth (majority, judge, format, length) score as 'exact'."""
    cfg = cfg or FilterConfig()
    if name not in CORRECTNESS and ":" not in name:
        name = "exact"
    verifier = make_verifier(name, cfg, task)
    verifier.name = name.rsplit(":", 1)[-1] if ":" in name else name
    stage = FilterStage([Channel(verifier.name, 1.0, verifier)],
                        _extractor(cfg, task), workers=0)

    def score(response: str, problem: Problem) -> tuple[float, str]:
        verdicts = stage.verdicts([Item(response, problem)])[0]
        rewards, reward, info, cause = stage.combine(verdicts)
        if cause:
            raise RuntimeError(f"scoring failed ({cause}): {info}")
        return reward, info
    return score


def eval_scorer(cfg, task: Task) -> Scorer:
    """The scorer held-out pass@1 should use for a training config (cfg: FilterConfig): its
    first ground-truth verifier (exact, math, gym, code or a user function), else exact."""
    names = list(weights_of(cfg.reward))
    truth = [n for n in names if n in CORRECTNESS or ":" in n]
    return make_scorer(truth[0] if truth else "exact", task, cfg)


def _extractor(cfg, task):
    return make_extractor(cfg.extract, task)
