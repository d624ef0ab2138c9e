"""The OpenAI request bodies the server takes (pydantic, so a malformed one is a 400 naming the
field) and the error body it answers with."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ROLES = ("system", "developer", "user", "assistant", "tool")


MAX_JSON_DEPTH = 64  # a body nesting deeper is refused: no request of the API needs it, and
# a 100,000-level one would exhaust the parser's and the validator's recursion
MAX_MESSAGES = 2_048  # messages of one chat request, counted before they are validated
MAX_PROMPTS = 2_048  # prompts of one /v1/completions request


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, code and the parameter at fault."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = \
            status, message, code, param, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def json_problem(data: Any) -> tuple[str, str] | None:
    """What makes a parsed body unusable, as (message, where), or None: nesting past
    MAX_JSON_DEPTH, or a string (key or value) that is not valid Unicode text (a lone
    surrogate such as "\\ud800", which JSON can spell but no UTF-8 text holds). Walked
    without recursion, so a deep body cannot exhaust the stack here."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return f"the body nests deeper than {MAX_JSON_DEPTH} levels", where
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str) and not _is_text(k):
                    return f"a key ({ascii(k)[:40]}) is not valid Unicode text (a lone " \
                           f"surrogate)", where
                stack.append((v, depth + 1, f"{where}.{k}" if where else str(k)))
        elif isinstance(value, str) and not _is_text(value):
            return "a string is not valid Unicode text (a lone surrogate such as \\ud800)", where
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]: only text is understood
            if any(not isinstance(p, dict) or p.get("type") != "text" or
                   not isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) "
                                 "are supported")
            return "".join(p["text"] for p in v)
        return v

    def plain(self) -> dict:
        """The message as the chat template reads it."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class Sampling(BaseModel):
    """What both endpoints share."""
    model_config = ConfigDict(extra="ignore")
    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("tools")
    @classmethod
    def _functions(cls, v):
        for t in v or []:
            f = t.get("function") if isinstance(t, dict) else None
            if not isinstance(f, dict) or t.get("type") != "function" or \
                    not isinstance(f.get("name"), str):
                raise ValueError("each tool must be {'type': 'function', 'function': "
                                 "{'name': ..., 'parameters': {...}}}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v):
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("tool_choice: 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        function = v.get("function") if isinstance(v, dict) else None
        if isinstance(v, dict) and not (isinstance(function, dict) and
                                        isinstance(function.get("name"), str)):
            raise ValueError("tool_choice: {'type': 'function', 'function': {'name': ...}}")
        return v


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty", "invalid_prompt", "prompt")
        return list(p)


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
