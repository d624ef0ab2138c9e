"""Environments for multi-turn episodes (generate.strategy=episode, generate.env=NAME).

    class Environment(Protocol):
        def reset(self, problem) -> str | dict | None
        def step(self, action: str) -> (observation, reward, done, info)

`reset` may return the first observation (None: the problem's own prompt opens the episode);
`step` gets the text of the model's turn and returns the next observation (a string, taken as
a user message, or a {"role", "content"} message; None when done), the turn's reward (the
episode's reward is their sum), whether the episode is over, and a dict for the stored sample.
An environment is built per episode by `factory(cfg, problem)`, by name (registry kind 'env')
or 'package.module:factory'.

Built in: `tools`, the model calls the tools generate.tools names (generate.tool_format:
hermes, json, or plain `name(argument)` for the character model; auto tries them in turn)
until it answers without a call; the answer is scored by exact match with
the problem's answer.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Protocol

from rollwise import registry
from rollwise.agents.toolcalls import parse_tool_calls
from rollwise.agents.tools import Toolbox


class Environment(Protocol):
    def reset(self, problem) -> str | dict | None: ...

    def step(self, action: str) -> tuple[str | dict | None, float, bool, dict[str, Any]]: ...


def build_env_factory(cfg):
    """factory(problem) -> Environment for generate.env."""
    make = registry.resolve("env", cfg.generate.env, "generate.env")
    return lambda problem: make(cfg, problem)


def as_message(observation: str | dict) -> dict:
    if isinstance(observation, str):
        return {"role": "user", "content": observation}
    if isinstance(observation, dict) and {"role", "content"} <= set(observation):
        return {"role": str(observation["role"]), "content": str(observation["content"])}
    raise ValueError(f"an environment's observation must be a string or a {{'role', "
                     f"'content'}} message, got {type(observation).__name__}: "
                     f"{str(observation)[:80]}")


class ToolEnv:
    """Tool calls until a plain answer: each call's result comes back as a `tool` message
    (an error observation for a bad call); a turn without a call is the answer, reward 1
    when it contains the problem's answer as a number, else 0."""

    def __init__(self, cfg, problem):
        self.answer = str(problem.answer).strip()
        self.toolbox = toolbox(tuple(cfg.generate.tools))
        self.format = cfg.generate.tool_format
        self.calls = 0

    def reset(self, problem):
        return None

    def parse(self, action: str):
        """The turn's calls in generate.tool_format; auto: hermes, else json, else plain calls
        of a tool this environment has."""
        if self.format != "auto":
            return parse_tool_calls(action, self.format)
        for fmt in ("hermes", "json"):
            if calls := parse_tool_calls(action, fmt):
                return calls
        return [c for c in parse_tool_calls(action, "plain") if c.name in self.toolbox.tools]

    def step(self, action: str):
        calls = self.parse(action)
        if not calls:
            numbers = re.findall(r"-?\d+(?:\.\d+)?", action)
            ok = bool(numbers) and numbers[-1] == self.answer
            return None, float(ok), True, {"tool_calls": self.calls}
        self.calls += len(calls)
        results = [self.toolbox.call(c)[0] for c in calls]
        return {"role": "tool", "content": "\n".join(results)}, 0.0, False, \
            {"tool_calls": self.calls}


@functools.cache
def toolbox(names: tuple[str, ...]) -> Toolbox:
    """One Toolbox per set of tool names, shared by the episodes that use it."""
    return Toolbox.from_names(list(names))
