"""How an environment's observation becomes tokens appended to an episode. What the model wrote
is never re-tokenized: an episode's ids are the engine's tokens plus the observation tokens
made here.

- ChatTurns: through the tokenizer's chat template. The observation's text is what the template
  renders after the model's end-of-turn token: the rest of the model's turn as the template
  writes it (e.g. the newline after <|im_end|>), then the new message and the generation
  prompt. Where the template does not render the model's turn as the model wrote it (a turn
  ended by eos instead of the end-of-turn token, a template that rewrites or drops text),
  the episode cannot go on exactly: `observation_ids` returns None and the caller starts a
  new sample from the re-rendered conversation, as prime-rl does.
- PlainTurns: the built-in character model, which has no template and no newline: rollwise's
  own plain-text turn, ";<role>: <content>;".
"""

from __future__ import annotations


class ChatTurns:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def observation_ids(self, messages: list[dict], turn_ids: list[int],
                        observation: dict) -> list[int] | None:
        """`messages` end with the model's turn (its text), whose tokens were `turn_ids`
        (the stop token included); the ids of the observation and the next generation
        prompt, or None when the template cannot extend the model's turn exactly."""
        head = self.render(messages[:-1], generation_prompt=True)
        with_turn = self.render(messages)
        written = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        if not with_turn.startswith(head + written):
            return None
        after = self.render(messages + [observation], generation_prompt=True)
        if not after.startswith(with_turn):
            return None
        text = with_turn[len(head) + len(written):] + after[len(with_turn):]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A whole conversation rendered with the generation prompt (a new sample's prompt)."""
        return self.tokenizer.encode(self.render(messages, generation_prompt=True),
                                     add_special_tokens=False)


class PlainTurns:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def observation_ids(self, messages: list[dict], turn_ids: list[int],
                        observation: dict) -> list[int]:
        return self.tokenizer.encode(plain_turn(observation), add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = "".join(plain_turn(m) for m in messages)
        return self.tokenizer.encode(text, add_special_tokens=False)


def plain_turn(message: dict) -> str:
    return f";{message['role']}: {message['content']};"


def turns_for(tokenizer):
    return ChatTurns(tokenizer) if getattr(tokenizer, "chat_template", None) else \
        PlainTurns(tokenizer)
