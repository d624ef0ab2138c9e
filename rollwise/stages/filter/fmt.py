"""Format and length rewards: cheap shaping channels for a composite reward (GDPO normalises
each channel separately, so they stay separate in `sample.rewards`).

format: 1 when an answer could be extracted and, if `pattern` is set, the whole stripped
        response matches it (re.fullmatch), else 0.
length: DAPO's soft overlong punishment (Yu et al. 2025, "overlong reward shaping"):
        0 up to max - buffer tokens, then falling linearly to -1 at max tokens, -1 beyond.
"""

from __future__ import annotations

import re

from rollwise.stages.filter.base import Item, Verdict, Verifier


class FormatVerifier(Verifier):
    isolated = False

    def __init__(self, pattern: str | None = None, name: str = "format"):
        try:
            self.pattern = re.compile(pattern, re.DOTALL) if pattern else None
        except re.error as e:
            raise ValueError(f"filter.format_pattern = {pattern!r} is not a regex: {e}") from e
        self.name = name

    def score(self, items: list[Item]) -> list[Verdict]:
        out = []
        for it in items:
            ok = it.answer is not None and (
                self.pattern is None or self.pattern.fullmatch(it.text.strip()) is not None)
            why = "ok" if ok else ("no answer" if it.answer is None else "pattern mismatch")
            out.append(Verdict({self.name: float(ok)}, why))
        return out

    def metrics(self) -> dict[str, float]:
        return {}


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment R_length(y) (Yu et al. 2025, §3.4):
         0                                   if |y| <= L_max - L_cache
         ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                   if |y| > L_max
    with L_max = max_length and L_cache = buffer (0: only the -1 past L_max)."""
    if length > max_length:
        return -1.0
    start = max_length - buffer
    return 0.0 if length <= start else (start - length) / buffer


class LengthVerifier(Verifier):
    isolated = False

    def __init__(self, max_tokens: int, buffer: int, name: str = "length"):
        if not 0 <= buffer < max_tokens:
            raise ValueError(f"filter.length_buffer = {buffer} must be in [0, length_max = "
                             f"{max_tokens})")
        self.max_tokens, self.buffer, self.name = max_tokens, buffer, name

    def score(self, items: list[Item]) -> list[Verdict]:
        return [Verdict({self.name: overlong_penalty(it.num_tokens, self.max_tokens, self.buffer)},
                        f"{it.num_tokens} tokens") for it in items]

    def metrics(self) -> dict[str, float]:
        return {}
