"""A prompt's text as a fixed-size vector, for similarity between prompts without a model:
hashed character n-grams (counts, L2-normalised). Two prompts of the same template and similar
numbers are close; the hash is crc32, so vectors are the same in every process and run."""

from __future__ import annotations

import zlib

import torch

from rollwise.types import Problem


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt's text: the string, or its messages' contents one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def features(texts: list[str], dim: int = 1024, n: int = 3) -> torch.Tensor:
    """(len(texts), dim) float32: each text's character n-gram counts hashed into dim buckets,
    scaled to unit length (a text shorter than n is one n-gram)."""
    out = torch.zeros((len(texts), dim), dtype=torch.float32)
    for i, text in enumerate(texts):
        grams = [text[k:k + n] for k in range(max(len(text) - n + 1, 1))]
        for g in grams:
            out[i, zlib.crc32(g.encode("utf-8", "replace")) % dim] += 1.0
    return torch.nn.functional.normalize(out, dim=1)


def problem_features(problems: list[Problem], dim: int = 1024) -> torch.Tensor:
    return features([prompt_text(p.prompt) for p in problems], dim)
