"""From a dataset row's prompt to the token ids the engine sees, made once per problem.

A prompt is a string or a list of chat messages ({"role", "content"}: TRL's conversational
format, verl's Parquet `prompt` column). `task.system_prompt` and `task.prompt_template`
("{prompt} Put the final answer in \\boxed{}.") are applied, then either the tokenizer's chat
template with the generation prompt (`task.chat_template`: auto uses it when the tokenizer has
one) or plain text. The ids are cached on the Problem: no step of the loop tokenizes again.

    prompter = Prompter(cfg.task, tokenizer, plain_task=task_is_builtin)
    ids = prompter.ids(problem)            # list[int], made on first use
    params.stop_ids = prompter.stop_ids    # eos and the template's end-of-turn token
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rollwise.config import TaskConfig

ROLES = ("system", "user", "assistant", "tool")
_PROBE = "rollwise-probe-7f3a"  # text no template changes, to find what follows a turn


def check_messages(messages: Any) -> str | None:
    """Why `messages` is not a usable chat prompt, or None when it is."""
    if not isinstance(messages, list) or not messages:
        return "a chat prompt must be a non-empty list of {role, content} messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {i} must be a mapping with 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has unknown role {m['role']!r} (known: {', '.join(ROLES)})"
        if not isinstance(m["content"], str):
            return (f"message {i} ({m['role']}) has {type(m['content']).__name__} content; "
                    "only string content is supported")
    return None


class Prompter:
    """Renders problems' prompts to ids (cached on each Problem) and knows the stop tokens."""

    def __init__(self, cfg: TaskConfig, tokenizer, *, plain_task: bool = False,
                 model_config: Any = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.chat_template == "on" and not has_template:
            raise ValueError("task.chat_template = on, but the tokenizer has no chat template: "
                             "use a tokenizer that has one (tokenizer_config.json "
                             "'chat_template'), or set task.chat_template = off (plain text)")
        self.chat = cfg.chat_template == "on" or (
            cfg.chat_template == "auto" and has_template and not plain_task)
        self.stop_ids = stop_ids(tokenizer, model_config, self.chat)
        self._texts: dict[tuple, str] = {}

    @classmethod
    def plain(cls, tokenizer) -> "Prompter":
        """Plain-text prompts, eos ends a response (the built-in character model's way)."""
        return cls(TaskConfig(chat_template="off"), tokenizer)

    @classmethod
    def for_task(cls, cfg: TaskConfig, tokenizer, task, model=None) -> "Prompter":
        """The prompter of a task (built-in arith keeps plain prompts under 'auto'), with the
        model's generation eos ids among the stop tokens."""
        return cls(cfg, tokenizer, plain_task=task.plain_prompts,
                   model_config=getattr(model, "generation_config", None))

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """The conversation to render: the system prompt (unless the row has one) and the
        template applied to the last user message (a string prompt is one user message)."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [dict(m) for m in prompt]
        why = check_messages(msgs)
        if why:
            raise ValueError(f"prompt: {why}")
        if self.cfg.prompt_template:
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            last = users[-1] if users else len(msgs) - 1
            msgs[last]["content"] = self.cfg.prompt_template.replace(
                "{prompt}", msgs[last]["content"])
        if self.cfg.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return msgs

    def render_text(self, prompt: str | list[dict]) -> str:
        """Plain rendering (no chat template): the messages' contents, one per line."""
        return "\n".join(m["content"] for m in self.messages(prompt))

    def ids(self, problem) -> list[int]:
        if problem.prompt_ids is None:
            problem.prompt_ids = self.encode(problem.prompt)
        return problem.prompt_ids

    def encode(self, prompt: str | list[dict]) -> list[int]:
        if not self.chat:  # a plain string prompt renders as itself (the built-in tiers')
            return list(self.tokenizer(self.render_text(prompt))["input_ids"])
        out = self.tokenizer.apply_chat_template(self.messages(prompt),
                                                 add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def unknown_characters(self, problems) -> tuple[int, list[str]]:
        """(occurrences, distinct characters) of the characters in the problems' prompts and
        worked solutions that the tokenizer can only map to its unknown token (a character
        model's vocabulary; a byte-level tokenizer knows every character)."""
        unk = self.tokenizer.unk_token_id
        if unk is None:
            return 0, []
        counts: Counter[str] = Counter()
        for p in problems:
            counts.update(self.render_text(p.prompt))
            counts.update(p.solution or "")
        unknown = [ch for ch in counts
                   if unk in self.tokenizer(ch, add_special_tokens=False)["input_ids"]]
        return sum(counts[ch] for ch in unknown), sorted(unknown)

    def render(self, problems) -> list:
        """The problems with their ids made (a no-op for those that have them)."""
        for p in problems:
            self.ids(p)
        return problems

    def text(self, problem) -> str:
        """The prompt as the model saw it, for the rollout store: the plain rendering, or the
        chat template's text with its special tokens (decoded once per problem)."""
        if not self.chat:
            return self.render_text(problem.prompt)
        ids = self.ids(problem)
        # keyed by the ids too: a copy of a problem asked another way (XRPO's seeded prompts
        # keep the prompt's id) is stored with the text it was asked with
        key = (problem.id, len(ids), hash(tuple(ids)))
        if key not in self._texts:
            self._texts[key] = self.tokenizer.decode(ids, skip_special_tokens=False)
        return self._texts[key]


def stop_ids(tokenizer, model_config: Any = None, chat: bool = True) -> tuple[int, ...]:
    """Token ids that end a response: the tokenizer's eos, the model's generation eos ids and,
    with a chat template, the token that closes an assistant turn (Qwen's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>: found by rendering a turn, not by name)."""
    out = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    out += [gen] if isinstance(gen, int) else list(gen or [])
    if chat and getattr(tokenizer, "chat_template", None):
        end = end_of_turn_id(tokenizer)
        if end is not None:
            out.append(end)
    out = list(dict.fromkeys(i for i in out if i is not None))
    if not out:
        raise ValueError("the tokenizer has no eos token and the chat template no end-of-turn "
                         "token: responses could never stop. Set the tokenizer's eos_token")
    return tuple(out)


def end_of_turn_id(tokenizer) -> int | None:
    """The first special token the chat template writes after an assistant message's text."""
    conv = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(conv, tokenize=False)
    except Exception:  # a template that cannot render this turn: eos alone ends responses
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    tail = text[at + len(_PROBE):]
    specials = {str(t): i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)}
    found = [(tail.find(s), i) for s, i in specials.items() if tail.find(s) >= 0]
    return min(found)[1] if found else None
