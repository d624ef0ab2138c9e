"""Tool calls parsed from a model turn, in the format the chat template teaches.

- hermes (Qwen2.5/3, Hermes, and rollwise's own plain-text format for models with no
  template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- json (Llama 3.x): the turn is one JSON object `{"name": ..., "parameters": {...}}`;
- plain (the built-in character model, whose vocabulary has no braces or quotes):
  `name(argument)`, the argument given to the tool's first parameter.

`detect(chat_template)` picks the format from the template's text. A block that is not valid
JSON or lacks a name is returned as a ToolCall with `error` set, so the environment can answer
it with an error observation rather than ignore it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: Any = field(default_factory=dict)
    error: str | None = None  # why the call could not be read
    positional: str | None = None  # plain format: the one argument, for the first parameter


def _from_object(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall(None, error=f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error="the call has no 'name'")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(name, error=f"arguments are not JSON ({e.msg})")
    return ToolCall(name, args)


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall(None, error="<tool_call> is not closed by </tool_call>"))
            continue
        try:
            calls.append(_from_object(json.loads(body), "arguments"))
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"not JSON ({e.msg} at character {e.pos})"))
        except RecursionError:  # model output nested past the parser's depth
            calls.append(ToolCall(None, error="not JSON (nested too deeply)"))
    return calls


def parse_json(text: str) -> list[ToolCall]:
    body = text.strip()
    if not body.startswith("{"):
        return []
    try:
        return [_from_object(json.loads(body), "parameters")]
    except json.JSONDecodeError as e:
        return [ToolCall(None, error=f"not JSON ({e.msg} at character {e.pos})")]
    except RecursionError:
        return [ToolCall(None, error="not JSON (nested too deeply)")]


_PLAIN = re.compile(r"([a-z_][a-z0-9_]*)\(([^()]*)\)")


def parse_plain(text: str) -> list[ToolCall]:
    return [ToolCall(m.group(1), {}, positional=m.group(2).strip())
            for m in _PLAIN.finditer(text)]


PARSERS = {"hermes": parse_hermes, "json": parse_json, "plain": parse_plain}


def detect(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches (hermes when it names none)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if '"parameters"' in t or "'parameters'" in t or "<|python_tag|>" in t:
        return "json"
    return "hermes"


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {sorted(PARSERS)}")
    return PARSERS[fmt](text)
