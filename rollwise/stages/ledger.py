"""Where the tokens and decisions went in a step. Every stage reports here with a reason, so
a run shows tokens trained on, filtered out (and why), paused and carried over, or aborted."""

from __future__ import annotations

from collections import Counter


class Ledger:
    def __init__(self):
        self.tokens: Counter[str] = Counter()  # category -> tokens
        self.decisions: Counter[str] = Counter()  # "stage/decision/reason" -> count

    def tokens_to(self, category: str, n: int) -> None:
        self.tokens[category] += n

    def decide(self, stage: str, decision: str, reason: str, n: int = 1) -> None:
        self.decisions[f"{stage}/{decision}/{reason}"] += n

    def metrics(self) -> dict[str, float]:
        out = {f"tokens/{k}": float(v) for k, v in self.tokens.items()}
        out.update({f"decisions/{k}": float(v) for k, v in self.decisions.items()})
        return out
