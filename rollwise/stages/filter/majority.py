"""Majority vote (test-time RL; TTRL, Zuo et al. 2025, as in ECHO's ttrl_utils): the most
common normalised answer of a group is its pseudo-label, and a sample's reward is 1 when its
answer agrees with it. The true answer is never read for the reward; it is read only for the
diagnostic `filter/majority_label_acc` (share of groups whose pseudo-label is right).

Ties go to the answer seen first in the group. Samples with no answer do not vote and get 0;
a group with no votes has no label.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from rollwise.stages.filter.base import Item, Verdict
from rollwise.stages.filter.extract import normalize


class MajorityVerifier:
    isolated = False

    def __init__(self, name: str = "majority"):
        self.name = name
        self._metrics: dict[str, float] = {}

    def score(self, items: list[Item]) -> list[Verdict]:
        groups: dict[int, list[int]] = defaultdict(list)
        for i, it in enumerate(items):
            groups[it.group].append(i)
        votes = [normalize(it.answer) for it in items]
        out: list[Verdict] = [Verdict()] * len(items)
        ratios, label_hits = [], []
        for members in groups.values():
            counts = Counter(votes[i] for i in members if votes[i] is not None)
            label, n = counts.most_common(1)[0] if counts else (None, 0)
            ratios.append(n / len(members))
            truth = normalize(items[members[0]].problem.answer)
            label_hits.append(float(label is not None and label == truth))
            for i in members:
                agree = label is not None and votes[i] == label
                why = f"answer={items[i].answer!r} label={label!r} votes={n}/{len(members)}"
                out[i] = Verdict({self.name: float(agree)}, why)
        self._metrics = {"filter/majority_ratio": sum(ratios) / max(len(ratios), 1),
                         "filter/majority_label_acc": sum(label_hits) / max(len(label_hits), 1)}
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
