"""A step's metrics, assembled from what the step produced (StepResult, below): one flat
dict per step for metrics.jsonl, TensorBoard and the report."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollwise.stages.generate.scope import distinct_correct
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Status


@dataclass
class StepResult:
    step: int
    scored: list[Group]  # this step's generated groups, scored, kept or not
    trained: list[Group]  # what the trainer updated on: kept groups, then replayed ones
    ledger: Ledger
    version: int  # the policy version after the update
    decoded: int  # tokens the engine decoded during the step's generation
    # tokens it prefilled (prompts, and resumed partial answers under APRIL); None: not counted
    prefilled: int | None = None
    dropped: list[Group] = field(default_factory=list)  # scored groups Filter left out
    # stored, never trained: rollouts SCOPE replaced, and its rectifications that scored no
    # higher than what they rectified
    aside: list[Group] = field(default_factory=list)
    replay: dict[str, float] = field(default_factory=dict)
    filter: dict[str, float] = field(default_factory=dict)  # summed over generation rounds
    train: dict[str, float] = field(default_factory=dict)
    sync: dict[str, float] = field(default_factory=dict)
    control: dict[str, float] = field(default_factory=dict)  # the in-flight controller's
    engine: dict[str, float] = field(default_factory=dict)  # a worker pool's (deaths, ...)
    seconds: dict[str, float] = field(default_factory=dict)  # gen, train, step


def trained_versions(r: StepResult) -> list[int]:
    """The policy version of every token trained on (an environment's tokens are not)."""
    return [v for g in r.trained for s in g.samples
            for v, m in zip(s.versions, s.loss_mask) if m]


def step_metrics(r: StepResult) -> dict[str, float]:
    samples = [s for g in r.scored for s in g.samples]
    scored = [s for s in samples if s.status != Status.FAILED]  # an unscored 0 is no reward
    n_gen = sum(s.num_tokens for s in samples)
    trained = trained_versions(r)
    ledger = r.ledger.metrics()
    # trained tokens of this step's generation (replayed ones are counted under replay/)
    ledger["tokens/trained"] = ledger.get("tokens/trained", 0.0) + float(
        int(r.train.get("train/tokens", 0) - r.replay.get("replay/tokens", 0)))
    return {
        **r.replay, **r.filter, **r.control, **r.engine,
        "perf/gen_seconds": r.seconds["gen"], **r.train,
        "perf/train_seconds": r.seconds["train"], **r.sync, **ledger,
        "step": r.step, "reward/mean": sum(s.reward for s in scored) / max(len(scored), 1),
        "groups/mixed_share": sum(g.is_mixed for g in r.scored) / len(r.scored),
        "groups/scored": len(r.scored), "groups/trained": len(r.trained),
        "groups/distinct_correct": distinct_correct(r.scored),
        "tokens/batch": sum(s.num_tokens for g in r.trained for s in g.samples),
        "tokens/stale": sum(v < r.version - 1 for v in trained),
        # versions between the policy updated (r.version - 1) and its oldest trained token
        "staleness/max": max((r.version - 1 - v for v in trained), default=0),
        "tokens/generated": n_gen, "tokens/decoded": r.decoded,
        "response/length_mean": n_gen / len(samples),
        "samples/total": len(samples),
        "samples/truncated": sum(s.status == Status.TRUNCATED for s in samples),
        "perf/gen_tokens_per_s": r.decoded / max(r.seconds["gen"], 1e-9),
        "perf/step_seconds": r.seconds["step"], "policy/version": r.version,
        **({"perf/wait_seconds": r.seconds["wait"]} if "wait" in r.seconds else {}),
        **({"tokens/prefilled": r.prefilled} if r.prefilled is not None else {}),
    }
