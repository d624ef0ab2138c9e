"""A user's own verifier, named by import path in the config ('package.module:name').

A function `fn(response: str, problem: Problem)` returning a number, (number, info), a dict
of channels or a Verdict runs isolated: one sample at a time in a worker process, with the
per-sample timeout, so a hang or a crash fails only that sample. A class with
`score(items) -> list[Verdict]` (the Verifier protocol) is instantiated with no arguments and
runs in-process on the whole batch unless it sets `isolated = True`.
"""

from __future__ import annotations

import importlib
import inspect

from rollwise import registry
from rollwise.stages.filter.base import Item, Verdict, Verifier, coerce


def import_object(path: str):
    if ":" not in path:
        raise ValueError(f"{path!r}: name a user verifier as 'package.module:function'")
    module, name = path.split(":", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e


class FunctionVerifier(Verifier):
    """Wraps a per-sample function; pickles as its import path (workers re-import it)."""

    isolated = user_code = True

    def __init__(self, path: str, name: str | None = None):
        self.path, self.name = path, name or path.split(":", 1)[-1]
        self._fn = None
        self.fn  # fail at build time, with the reason, when it cannot be imported

    @property
    def fn(self):
        if self._fn is None:
            self._fn = import_object(self.path)
        return self._fn

    def warm(self) -> None:
        self.fn

    def __getstate__(self):
        return {"path": self.path, "name": self.name, "_fn": None}

    def score(self, items: list[Item]) -> list[Verdict]:
        return [coerce(self.fn(it.text, it.problem), self.name) for it in items]

    def metrics(self) -> dict[str, float]:
        return {}


def user_verifier(path: str, name: str | None = None):
    obj = import_object(path)
    if inspect.isclass(obj):
        try:
            inst = registry.conform(obj(), Verifier, path)
        except TypeError as e:
            raise ValueError(f"{path}: a verifier class needs score(items) -> list[Verdict] "
                             f"({e})") from None
        inst.name = name or inst.name or path.split(":", 1)[-1]
        inst.isolated, inst.user_code = bool(inst.isolated), True
        return inst
    if not callable(obj):
        raise ValueError(f"{path} is a {type(obj).__name__}, not a function or verifier class")
    return FunctionVerifier(path, name)
