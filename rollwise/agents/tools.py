"""Tools for agent episodes: typed Python functions whose signature and docstring are the
schema (as in TRL: transformers.utils.get_json_schema reads them), called with arguments the
model wrote, each call in a child process with a wall-clock limit (in this process for a
function marked `bounded`, whose own limits bound its work).

A tool call never crashes an episode: a malformed call, an unknown tool, arguments that do
not fit the schema, a tool that raises, hangs past its limit or returns something that is not
text all come back as an error observation the model can read ("error: ...").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from transformers.utils import get_json_schema

from rollwise import registry
from rollwise.agents.toolcalls import ToolCall
from rollwise.waits import NoAnswer, Peer, PeerDied, answers

_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool,
               "array": list, "object": dict}


@dataclass
class Tool:
    fn: Callable[..., Any]
    schema: dict  # OpenAI function schema: {"type": "function", "function": {...}}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> "Tool":
        """The schema from fn's type hints and Google-style docstring (an 'Args:' section
        naming every parameter); a missing hint or description is a clear error."""
        try:
            schema = get_json_schema(fn)
        except Exception as e:
            raise ValueError(
                f"tool {getattr(fn, '__name__', fn)!r}: its schema comes from type hints and a "
                f"docstring with an 'Args:' section describing every parameter ({e})") from None
        return cls(fn, schema)

    def check_arguments(self, args: Any) -> str | None:
        """Why `args` do not fit the schema, or None."""
        params = self.schema["function"]["parameters"]
        props = params.get("properties", {})
        if not isinstance(args, dict):
            return f"arguments must be a JSON object, got {type(args).__name__}"
        missing = [k for k in params.get("required", []) if k not in args]
        unknown = [k for k in args if k not in props]
        if missing or unknown:
            why = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
            return "; ".join(why) + f" (parameters: {list(props)})"
        for k, v in args.items():
            want = _JSON_TYPES.get(props[k].get("type"))
            if want and (not isinstance(v, want) or (isinstance(v, bool) and want is not bool)):
                return f"argument {k!r} must be {props[k]['type']}, got {json.dumps(v)[:40]}"
            if "enum" in props[k] and v not in props[k]["enum"]:
                return f"argument {k!r} must be one of {props[k]['enum']}"
        return None


def _child(fn, args, conn) -> None:
    try:
        conn.send(("ok", fn(**args)))
    except BaseException as e:  # the tool's own failure, reported to the model
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        conn.send(("raised", tb))
    finally:
        conn.close()


@dataclass
class ToolLimits:
    timeout_s: float = 5.0
    max_chars: int = 2000  # an observation longer than this is cut, saying so


class Toolbox:
    """The tools of an environment, by name; `call` turns one parsed call into the text of
    its observation."""

    def __init__(self, tools: list[Callable | Tool], limits: ToolLimits = ToolLimits()):
        self.tools = {}
        for t in tools:
            tool = t if isinstance(t, Tool) else Tool.from_function(t)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.limits = limits

    @classmethod
    def from_names(cls, names: list[str], limits: ToolLimits = ToolLimits()) -> "Toolbox":
        """Tools by built-in name (calculator, python), registered name or
        'package.module:function'."""
        return cls([registry.resolve("tool", n, "tools") for n in names], limits)

    @property
    def schemas(self) -> list[dict]:
        """For the chat template's `tools=` argument."""
        return [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """(observation text, ok)."""
        if call.error:
            return f"error: malformed tool call: {call.error}", False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", False
        if call.positional is not None:  # plain format: the first parameter's value
            params = list(tool.schema["function"]["parameters"].get("properties", {}))
            if not params:
                return f"error: {call.name} takes no argument", False
            call = ToolCall(call.name, {params[0]: call.positional})
        why = tool.check_arguments(call.arguments)
        if why:
            return f"error: {call.name}: {why}", False
        status, value = self._run(tool, call.arguments)
        if status == "raised":
            return f"error: {call.name} raised {value}", False
        if status == "timeout":
            return f"error: {call.name} did not answer within {self.limits.timeout_s:g} s", False
        if status == "died":
            return f"error: {call.name} died ({value})", False
        return self._text(value), True

    def _run(self, tool: Tool, args: dict) -> tuple[str, Any]:
        """The tool in a forked child: a hang or a crash there cannot take the run down. A
        function marked `bounded = True` (its own limits bound its time and memory, as the
        calculator's do) runs in this process: a fork costs more than its work."""
        if getattr(tool.fn, "bounded", False):
            try:
                return "ok", tool.fn(**args)
            except Exception as e:
                return "raised", traceback.format_exception_only(type(e), e)[-1].strip()
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(tool.fn, args, send), daemon=True)
        proc.start()
        send.close()
        try:
            (reply,) = answers([Peer(f"tool {tool.name}", proc, recv)], "answer",
                               self.limits.timeout_s)
            return reply
        except NoAnswer:
            return "timeout", None
        except PeerDied as e:  # the child died without answering
            return "died", e.how
        except Exception as e:  # an answer that does not unpickle
            return "died", f"unreadable result: {type(e).__name__}"
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(1)
            recv.close()

    def _text(self, value: Any) -> str:
        """A tool's result as observation text: strings as they are, the rest as JSON (or
        repr), cut at max_chars."""
        if not isinstance(value, str):
            try:
                value = json.dumps(value)
            except (TypeError, ValueError):
                value = repr(value)
        n = self.limits.max_chars
        return value if len(value) <= n else value[:n] + f"... [cut at {n} characters]"
