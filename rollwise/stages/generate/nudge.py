"""NudgeRL's strategy nudging (generate.strategy=nudge; docs/methods.md#nudgerl): each prompt's
group is split over `per_prompt` strategy contexts, short hints from generate.nudge.contexts
or contexts_file; a rollout is asked with its context joined to the prompt's last user message
(generate.nudge.template), or plainly with probability plain_share. Each sample's context index
is in meta["nudge"] (-1: plain), where train.advantage=nudge splits the reward and the trainer's
distillation term (train.nudge.distill_coef) finds which responses to teach the plain prompt.

Contexts are the user's, never derived from answers. The draw of contexts and of plain rollouts
is a function of the run's seed, the step and the prompt id, so a resumed run draws the same.
Held-out evaluation asks every prompt plainly.
"""

from __future__ import annotations

import random

from rollwise import presets
from rollwise.config import ConfigError
from rollwise.stages.generate.group import GroupGenerator, new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.types import Group, Problem

MAX_CONTEXTS = 10_000
MAX_CONTEXT_CHARS = 2_000


def load_contexts(cfg) -> list[str]:
    """generate.nudge.contexts, then the lines of contexts_file; a clear error for none, an
    unreadable file, or a context too long to be a hint."""
    c = cfg.generate.nudge
    contexts = [x.strip() for x in c.contexts if x.strip()]
    if c.contexts_file:
        path = presets.side_file(c.contexts_file)  # a preset's side file by its name too
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"generate.nudge.contexts_file = {str(path)!r}: cannot read it "
                              f"({type(e).__name__}: {e})") from None
        contexts += [x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")]
    if not contexts:
        raise ConfigError("generate.strategy = nudge found no strategy contexts: list them in "
                          "generate.nudge.contexts or generate.nudge.contexts_file")
    long = [x for x in contexts if len(x) > MAX_CONTEXT_CHARS]
    if long or len(contexts) > MAX_CONTEXTS:
        raise ConfigError(f"generate.nudge: {len(contexts)} contexts, {len(long)} longer than "
                          f"{MAX_CONTEXT_CHARS} characters; a context is a short hint "
                          f"(at most {MAX_CONTEXTS} of them)")
    return contexts


class NudgeGenerator(GroupGenerator):
    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        c = cfg.generate.nudge
        self.contexts = load_contexts(cfg)
        self.per_prompt = min(c.per_prompt, len(self.contexts))
        self.plain_share, self.draw, self.template = c.plain_share, c.draw, c.template
        self.seed = cfg.run.seed
        self.prompter = None
        self.ids: dict[tuple, list[int]] = {}  # (plain prompt ids, context) -> nudged ids

    def bind(self, prompter=None, **_) -> None:
        self.prompter = prompter

    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        if self.prompter is None:
            raise RuntimeError("generate.strategy = nudge renders nudged prompts with the run's "
                               "prompter: call bind(prompter=...) before generate")
        for p in problems:
            contexts = self.assign(p.id, p.group_size or self.group_size, step)
            samples = [new_sample(p, self.prompt_ids(p, c), step) for c in contexts]
            for s, c in zip(samples, contexts):
                s.meta["nudge"] = c
            rollout.add(Group(p.id, samples, p))
        rollout.run()

    def assign(self, pid: str, n: int, step: int) -> list[int]:
        """Each of n rollouts' context index (-1: plain): per_prompt contexts shared out in
        turn, then each rollout made plain with probability plain_share."""
        rng = random.Random(f"nudge:{self.seed}:{step}:{pid}")
        k = len(self.contexts)
        if self.draw == "random":
            chosen = rng.sample(range(k), self.per_prompt)
        else:  # the list in turn, from where the previous step's prompts left it
            first = (step * self.per_prompt) % k
            chosen = [(first + j) % k for j in range(self.per_prompt)]
        slots = [chosen[j * self.per_prompt // n] for j in range(n)]
        return [-1 if rng.random() < self.plain_share else c for c in slots]

    def prompt_ids(self, p: Problem, context: int) -> list[int]:
        if context < 0:
            return p.prompt_ids
        key = (tuple(p.prompt_ids), context)
        if key not in self.ids:
            if len(self.ids) > 4 * MAX_CONTEXTS:
                self.ids.clear()
            self.ids[key] = self.prompter.encode(self.nudged(p.prompt, self.contexts[context]))
        return self.ids[key]

    def nudged(self, prompt: str | list[dict], context: str) -> str | list[dict]:
        """The prompt with the context joined to its last user message."""
        fill = lambda text: self.template.replace("{context}", context).replace(  # noqa: E731
            "{prompt}", text)
        if isinstance(prompt, str):
            return fill(prompt)
        msgs = [dict(m) for m in prompt]
        users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
        if not users:
            raise ValueError("generate.strategy = nudge: a chat prompt with no user message "
                             "has nowhere to put the context")
        msgs[users[-1]]["content"] = fill(msgs[users[-1]]["content"])
        return msgs
