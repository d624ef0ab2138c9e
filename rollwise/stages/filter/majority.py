"""Majority vote (test-time RL; TTRL, Zuo et al. 2025, as in ECHO's ttrl_utils): the most
common normalised answer of a group is its pseudo-label, and a sample's reward is 1 when its
answer agrees with it, else 0. The true answer is never read for the reward; it is read only
for the diagnostic `filter/majority_label_acc`.

Which answers vote, and when a group has a label at all:
- a sample with no answer (the extractor found none, or it normalises to nothing) does not
  vote and never wins; it still counts in the group's size, so a group that mostly failed to
  answer has a low majority ratio;
- a tie for the most votes gives no label: picking one by sample order would reward an
  arbitrary answer;
- with `min_ratio` r > 0 the winner needs more than r of the group's samples (0.5: a strict
  majority). TTRL takes the plurality (r = 0); on a small group a plurality is often a wrong
  answer that won by chance, and rewarding it teaches the policy its own slips.
A group without a label gives every sample 0: equal rewards, no GRPO signal (such groups are
dropped by filter.drop_equal_reward_groups).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from rollwise.stages.filter.base import Item, Verdict, Verifier
from rollwise.tasks.extract import normalize


def majority_label(votes: list[str | None], min_ratio: float = 0.0) -> tuple[str | None, int]:
    """(label or None, votes for the most common answer) of one group's normalised answers."""
    counts = Counter(v for v in votes if v is not None)
    top = counts.most_common(2)
    if not top:
        return None, 0
    label, n = top[0]
    if len(top) > 1 and top[1][1] == n:
        return None, n  # a tie: no label
    if n <= min_ratio * len(votes):
        return None, n  # not enough agreement
    return label, n


class MajorityVerifier(Verifier):
    isolated = False

    def __init__(self, name: str = "majority", min_ratio: float = 0.0):
        if not 0.0 <= min_ratio < 1.0:
            raise ValueError(f"filter.majority_min_ratio = {min_ratio}: use a share in [0, 1)")
        self.name, self.min_ratio = name, min_ratio
        self._metrics: dict[str, float] = {}

    def score(self, items: list[Item]) -> list[Verdict]:
        groups: dict[int, list[int]] = defaultdict(list)
        for i, it in enumerate(items):
            groups[it.group].append(i)
        votes = [normalize(it.answer) for it in items]
        out: list[Verdict] = [Verdict()] * len(items)
        ratios, hits, labelled = [], [], 0
        for members in groups.values():
            label, n = majority_label([votes[i] for i in members], self.min_ratio)
            ratios.append(n / len(members))
            if label is not None:
                labelled += 1
                hits.append(float(label == normalize(items[members[0]].problem.answer)))
            for i in members:
                agree = label is not None and votes[i] == label
                why = f"answer={items[i].answer!r} label={label!r} votes={n}/{len(members)}"
                out[i] = Verdict({self.name: float(agree)}, why)
        self._metrics = {"filter/majority_ratio": sum(ratios) / max(len(ratios), 1),
                         "filter/majority_labelled": labelled / max(len(groups), 1)}
        if hits:  # share of labelled groups whose label is the true answer (diagnostic)
            self._metrics["filter/majority_label_acc"] = sum(hits) / len(hits)
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
