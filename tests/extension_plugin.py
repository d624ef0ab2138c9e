"""A third-party extension, outside rollwise/: a generator, a selector, an in-flight controller
and a verifier, named in a config by dotted path (tests/test_extension.py). It uses only the
public protocols; nothing in rollwise/ knows about it."""

from __future__ import annotations

from rollwise.stages.control.inflight import CONTINUE, Decision
from rollwise.stages.filter.base import Verdict
from rollwise.types import Group, Sample

HINT = "? "  # the generator's prompt prefix, so its groups can be recognised downstream


class HintedGenerator:
    """group_size samples per prompt, each prompt prefixed with HINT."""

    def __init__(self, cfg, tokenizer):
        self.size, self.tok = cfg.generate.group_size, tokenizer

    def generate(self, rollout, problems, step):
        for p in problems:
            ids = self.tok(HINT + p.prompt)["input_ids"]
            rollout.add(Group(p.id, [Sample(prompt_id=p.id, prompt_ids=list(ids), step=step,
                                            group_id=f"{step}:{p.id}")
                                     for _ in range(self.size)], p))
        rollout.run()


class EvenSelector:
    """Prompts whose id ends in an even digit, in pool order, continuing where it stopped."""

    def __init__(self, cfg):
        self.next = 0

    def select(self, pool, n, rng):
        even = [p for p in pool if p.id[-1] in "02468"]
        out = [even[(self.next + i) % len(even)] for i in range(n)]
        self.next += n
        return out

    def observe(self, outcomes, step):
        pass

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class CapAtTwo:
    """Aborts a response at its first event past two tokens."""

    def __init__(self, cfg):
        pass

    def begin(self, want, step):
        return [], want

    def on_event(self, event, sample, rollout):
        return Decision("abort", "cap") if sample.num_tokens > 2 else CONTINUE

    def end(self, rollout, want):
        return list(rollout.groups)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class FirstDigit:
    """Verifier class: 1 when the response starts with the answer's first digit."""

    name = "first_digit"
    isolated = False

    def score(self, items):
        return [Verdict({self.name: float(it.text[:1] == it.problem.answer[:1])}, it.text[:4])
                for it in items]

    def metrics(self):
        return {}
