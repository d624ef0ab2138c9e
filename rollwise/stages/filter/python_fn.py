"""A reward given as a Python object (rollwise.train(reward=fn)), not by import path.

Two call styles, told apart by the signature:
- rollwise's `fn(response: str, problem: Problem)`, one sample at a time, returning a number,
  (number, info), a dict of channels or a Verdict;
- TRL's `fn(prompts, completions, **kwargs) -> list[float | None]`, one call per batch, with
  the dataset's other columns as keyword lists (completions are chat messages when the
  prompts are).

A per-sample function runs isolated in a worker process, with the per-sample timeout, as
dotted-path rewards do: it is sent there with cloudpickle, by reference when it is importable
and by value (its code and what it refers to) when it is defined in a script, a notebook, a
closure or a lambda. One that cannot be serialised (it holds a lock, a socket, a model) and
TRL's batch style run in this process: an exception fails only their samples, but a hang
cannot be timed out, and the run says so when it starts.
"""

from __future__ import annotations

import inspect
import re

import cloudpickle

from rollwise.stages.filter.base import BAD_OUTPUT, ERROR, Item, Verdict, Verifier, coerce


def reward_name(fn) -> str:
    name = re.sub(r"\W", "_", getattr(fn, "__name__", type(fn).__name__)) or "reward"
    return name if name != "_lambda_" else "reward"


def _trl_style(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] in ("prompts", "completions")


def _sendable(fn) -> bool:
    try:
        cloudpickle.dumps(fn)
        return True
    except Exception:  # whatever it refers to may fail to serialise, in any way
        return False


class CallableVerifier(Verifier):
    def __init__(self, fn, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"reward: {fn!r} is not callable; give a function "
                            "fn(response, problem) or TRL's fn(prompts, completions, **kw)")
        self.fn, self.name = fn, name or reward_name(fn)
        self.batched = _trl_style(fn)
        self.isolated = not self.batched and _sendable(fn)
        self.user_code = True

    def score(self, items: list[Item]) -> list[Verdict]:
        return self._batch(items) if self.batched else [self._one(it) for it in items]

    def _one(self, it: Item) -> Verdict:
        try:
            return coerce(self.fn(it.text, it.problem), self.name)
        except Exception as e:  # one bad sample fails alone
            return Verdict.failure(ERROR, f"{self.name}: {type(e).__name__}: {e}")

    def _batch(self, items: list[Item]) -> list[Verdict]:
        prompts = [it.problem.prompt for it in items]
        completions = [[{"role": "assistant", "content": it.text}]
                       if isinstance(it.problem.prompt, list) else it.text for it in items]
        columns = {k for it in items for k in it.problem.data} - {"prompt", "completions"}
        kwargs = {k: [it.problem.data.get(k) for it in items] for k in sorted(columns)}
        kwargs.setdefault("answer", [it.problem.answer for it in items])
        try:
            out = list(self.fn(prompts=prompts, completions=completions, **kwargs))
        except Exception as e:
            return [Verdict.failure(ERROR, f"{self.name}: {type(e).__name__}: {e}")] * len(items)
        if len(out) != len(items):
            return [Verdict.failure(BAD_OUTPUT, f"{self.name}: returned {len(out)} rewards "
                                                f"for {len(items)} completions")] * len(items)
        return [Verdict.failure(BAD_OUTPUT, f"{self.name}: returned None") if v is None
                else coerce(v, self.name) for v in out]

    def metrics(self) -> dict[str, float]:
        return {}
