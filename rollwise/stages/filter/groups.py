"""The Filter stage as the step sees it: score groups (every sample gets its reward channels and
the composite reward), then keep or drop each group, with the reason.

    flt = build_group_filter(cfg, task, tokenizer)
    metrics = flt.score(groups)                 # rewards into every sample
    parts = [scored_part(g, ledger) for g in groups]    # what may be trained
    kept = [g for g in parts if keep(flt, g, ledger)]   # drops counted by reason

Rewards are final here: shaping such as DAPO's soft overlong penalty is a reward channel
(`length`), so the trainer takes scored groups as they are. A sample no verifier could score
(status FAILED: it raised, hung, crashed or returned garbage) is stored with its reason but
never trained on, nor counted in its group's statistics: `scored_part` leaves it out, and a
group left with too few scored samples is dropped (reason `too_few_scored`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from rollwise.stages.filter.stage import FilterStage, build_filter
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Status

KEEP = (True, "")


class Filter(Protocol):
    def score(self, groups: list[Group]) -> dict[str, float]:
        """Set rewards (sample.rewards, .reward, .reward_info; FAILED on a verifier failure);
        returns metrics."""

    def keep(self, group: Group) -> tuple[bool, str]:
        """(keep, reason it was dropped)."""

    def close(self) -> None: ...


def signal(group: Group) -> tuple[bool, str]:
    """DAPO dynamic sampling's rule: a group carries a learning signal only if its rewards
    differ (equal rewards give every GRPO advantage 0)."""
    if len(group.samples) < 2:
        return False, "single_sample"
    r = group.rewards
    return (True, "") if max(r) != min(r) else (False, "equal_reward")


class RewardFilter:
    """The configured verifiers (FilterStage) over decoded responses, and the signal rule
    (filter.drop_equal_reward_groups)."""

    def __init__(self, stage: FilterStage, tokenizer, drop_equal_reward: bool = True):
        self.stage, self.tokenizer, self.drop_equal = stage, tokenizer, drop_equal_reward

    def score(self, groups: list[Group]) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples]
        problems = [g.problem for g in groups for _ in g.samples]
        # an agent's final answer (rollwise.serve.agent) is what it says, not its last turn
        texts = [s.meta["final_answer"] if "final_answer" in s.meta else
                 self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                 for s in samples]
        return self.stage.score(samples, problems, texts)

    def keep(self, group: Group) -> tuple[bool, str]:
        return signal(group) if self.drop_equal else KEEP

    def attach_engine(self, engine, tokenizer) -> None:
        self.stage.attach_engine(engine, tokenizer)

    def unbounded(self) -> list[str]:
        return self.stage.unbounded()

    def close(self) -> None:
        self.stage.close()


def build_group_filter(cfg, task, tokenizer) -> RewardFilter:
    """cfg: the run's Config."""
    return RewardFilter(build_filter(cfg.filter, task), tokenizer,
                        cfg.filter.drop_equal_reward_groups)


def scored_part(group: Group, ledger: Ledger) -> Group:
    """The group without its unscored samples (status FAILED), which are counted (decision
    filter/unscored/<n>, tokens/unscored) and marked so `keep` drops a group they leave with
    fewer than two scored samples of two or more. The group itself, when all were scored."""
    failed = [s for s in group.samples if s.status == Status.FAILED]
    if not failed:
        return group
    ledger.decide("filter", "unscored", "verifier_failed", len(failed))
    ledger.tokens_to("unscored", sum(s.num_tokens for s in failed))
    scored = [s for s in group.samples if s.status != Status.FAILED]
    return dataclasses.replace(group, samples=scored, unscored=len(failed))


def keep(flt: Filter, group: Group, ledger: Ledger) -> bool:
    """flt.keep, with a drop counted in the ledger by its reason (decisions and tokens). A
    group that lost samples to failed scoring is kept only with at least two scored samples
    (one when it had one to begin with)."""
    n = len(group.samples)
    kept, reason = (False, "too_few_scored") if n < min(2, n + group.unscored) else \
        flt.keep(group)
    if not kept:
        ledger.decide("filter", "drop", reason)
        ledger.tokens_to(f"filtered/{reason}", sum(s.num_tokens for s in group.samples))
    return kept
