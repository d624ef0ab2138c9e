"""One line of a longer description: what `rollwise configs list` and `rollwise bench` print."""

from __future__ import annotations

import re


def first_sentence(text: str, width: int = 110, colon: bool = True) -> str:
    """The first sentence of `text` with its whitespace folded, at most `width` characters; a
    sentence ends at ". " after a word (not inside "i.i.d." or "et al."), at "; ", and where
    `colon`, at ": "."""
    text = " ".join(text.split())
    ends = r"(?<=[a-z0-9)`]{2})(?<! al)\. |; " + ("|: " if colon else "")
    text = re.split(ends, text, maxsplit=1)[0].rstrip(".:;,")
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."
