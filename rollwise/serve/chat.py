"""Chat calls as token ids, and calls that continue a conversation as one token-exact sample.

A call's prompt is its messages rendered by the tokenizer's chat template (with `tools` where
given; the built-in character model, which has no template, uses rollwise's plain turns, as
its episodes do: the opening user message as the prompt itself, then ';role: text;' turns). When
a call continues an earlier call of the same episode — its messages are that call's messages,
then the assistant message the server returned (as the client sends it back), then anything
new (tool results, a user turn) — its prompt is the earlier prompt, the engine's own tokens of
the earlier answer (never re-tokenized from text), and the template's rendering of what was
added. That holds only where the template renders the model's turn as the model wrote it; where
it does not, or the client changed the history, the call starts a new sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rollwise.agents.toolcalls import ToolCall, detect, parse_tool_calls
from rollwise.agents.turns import plain_turn


class TooLong(ValueError):
    """A rendered prompt of more characters than Renderer.max_chars: refused untokenized."""

    def __init__(self, chars: int, limit: int):
        super().__init__(f"the rendered prompt has {chars} characters, more than {limit}")
        self.chars = chars


class Renderer:
    """Messages (and tools) as the text and ids a model is prompted with. `max_chars`: the
    most characters a rendered text may have to be tokenized (a server sets it from the
    context: text past it cannot fit, and tokenizing it would cost seconds for nothing)."""

    def __init__(self, tokenizer, max_chars: int | None = None):
        self.tokenizer, self.max_chars = tokenizer, max_chars
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.tool_format = detect(tokenizer.chat_template) if self.chat else "plain"
        # a template that writes tool calls itself wants only the text around them back
        self.renders_tool_calls = self.chat and "tool_calls" in tokenizer.chat_template

    def text(self, messages: list[dict], generation_prompt: bool, tools=None) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=generation_prompt)
        # rollwise's plain turns, as episodes write them: the opening user message is the
        # prompt as it stands (as the task's prompts are), the model's turns end with eos,
        # and every later message is a ';role: text;' turn
        eos = self.tokenizer.eos_token or ""
        return "".join(
            (m.get("content") or "") + eos if m["role"] == "assistant" else
            (m.get("content") or "") if i == 0 and m["role"] == "user" else
            plain_turn({"role": m["role"], "content": m.get("content") or ""})
            for i, m in enumerate(messages))

    def encode(self, text: str) -> list[int]:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise TooLong(len(text), self.max_chars)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools=None) -> list[int]:
        return self.encode(self.text(messages, True, tools))

    def answer(self, completion_ids: list[int], stop_ids) -> tuple[str, list[ToolCall]]:
        """What the model wrote (its stop token left out) and the tool calls in it."""
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in stop_ids \
            else completion_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text, parse_tool_calls(text, self.tool_format)


@dataclass
class Turn:
    """A finished call of an episode: what it was asked and what the engine answered."""
    messages: list[dict]  # the call's messages, as sent
    tools: list | None
    answer: dict  # the assistant message the server returned
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class Piece:
    """One sample being assembled from consecutive calls: ids with, per response token, the
    behaviour log-probability, the version that sampled it (-1: not the model's) and whether
    the model wrote it (the loss mask)."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    last: Turn | None = None
    calls: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add(self, ids: list[int], logprobs=(), versions=(), entropies=()) -> None:
        """The model's tokens (with their log-probabilities, versions and entropies), or,
        without them, tokens the model did not write (masked out, version -1)."""
        model = bool(len(logprobs))
        self.response_ids += ids
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)
        self.versions += list(versions) if model else [-1] * len(ids)
        self.entropies += list(entropies) if model else [0.0] * len(ids)
        self.mask += [model] * len(ids)


def same_message(a: dict, b: dict) -> bool:
    """The client's copy of a message equals the server's: role, text and tool calls (their
    arguments compared as JSON values, whatever the spacing)."""
    return a.get("role") == b.get("role") and (a.get("content") or "") == \
        (b.get("content") or "") and _calls(a) == _calls(b)


def _calls(m: dict) -> list:
    out = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", {})
        args = f.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        out.append((f.get("name"), args))
    return out


def continuation_ids(r: Renderer, turn: Turn, messages: list[dict], tools) -> list[int] | None:
    """The ids `messages` add after `turn`'s answer when they continue it exactly, else None."""
    n = len(turn.messages)
    if (tools or None) != (turn.tools or None) or len(messages) <= n + 1 or \
            not all(same_message(a, b) for a, b in zip(messages[:n], turn.messages)) or \
            not same_message(messages[n], turn.answer):
        return None
    head = r.text(turn.messages, True, tools)
    written = r.tokenizer.decode(turn.completion_ids, skip_special_tokens=False)
    with_turn = r.text(messages[:n + 1], False, tools)
    if not with_turn.startswith(head + written):
        return None  # the template does not render the model's turn as the model wrote it
    after = r.text(messages, True, tools)
    if not after.startswith(with_turn):
        return None
    return r.encode(with_turn[len(head) + len(written):] + after[len(with_turn):])


class Transcript:
    """One episode's calls as samples: a call that continues an earlier piece's last call
    extends that piece; any other starts a new piece (counted in `splits`, after the first)."""

    def __init__(self, renderer: Renderer):
        self.r, self.pieces, self.splits = renderer, [], 0

    def prompt(self, messages: list[dict], tools) -> Continued:
        """The call's prompt ids, and the piece it continues (None: a new one) with the ids
        it adds to that piece."""
        for piece in reversed(self.pieces):
            added = continuation_ids(self.r, piece.last, messages, tools)
            if added is not None:
                return Continued(piece.ids + added, piece, piece.last, added)
        return Continued(self.r.prompt_ids(messages, tools))

    def record(self, at: Continued, turn: Turn, logprobs, versions, entropies) -> None:
        """The finished call, into the piece it continued; into a new piece when it started
        one, or when another call of the episode extended that piece meanwhile."""
        piece = at.piece
        if piece is None or piece.last is not at.base:
            piece = Piece(turn.prompt_ids)
            self.splits += bool(self.pieces)
            self.pieces.append(piece)
        else:
            piece.add(at.added)
        piece.add(turn.completion_ids, logprobs, versions, entropies)
        piece.last, piece.calls = turn, piece.calls + 1


@dataclass
class Continued:
    prompt_ids: list[int]
    piece: Piece | None = None
    base: Turn | None = None  # the piece's last call when this one began
    added: list[int] = field(default_factory=list)
