"""A third-party extension, outside rollwise/: a generator, a selector, an in-flight controller
and a verifier, named in a config by dotted path (tests/test_extension.py); and an episodic
pair, a task played as two-turn dialogues and the generator that plays them, with its own
held-out evaluation and warm-start examples. It uses only the public protocols; nothing in
rollwise/ knows about it."""

from __future__ import annotations

import random

from rollwise.engine import SamplingParams
from rollwise.stages.control.inflight import CONTINUE, Decision, RunToEnd
from rollwise.stages.filter.base import Verdict
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks.base import Task
from rollwise.types import Group, Problem, Sample, Status

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


# ---- an episodic extension: two-turn dialogues ---------------------------------------------
NUDGE = " again:"  # the environment's turn between the model's two, never trained
WARM_CALLS: list[int] = []  # examples DialogueGenerator.warm_start_examples made, per call


class DialogueTask(Task):
    """Say a digit twice: the prompt names it, the model answers, the environment asks again,
    the model answers again. Played only as dialogues (a plain generator cannot play it)."""

    played_as = "dialogues"

    def __init__(self, cfg):
        rng = random.Random(cfg.seed)
        digits = [str(rng.randrange(10)) for _ in range(64 + cfg.eval_size)]
        problems = [Problem(f"d{i}", f"say {d}:", d, solution=d) for i, d in enumerate(digits)]
        self.train, self.eval = problems[:64], problems[64:]

    def extract_answer(self, response: str) -> str | None:
        return response.strip()[:1] or None


class DialogueGenerator(Generator):
    """group_size dialogues per prompt, each one sample: the model's first turn, the
    environment's NUDGE (loss mask 0, version -1), the model's second turn."""

    produces = "dialogues"

    def __init__(self, cfg, tokenizer):
        self.size, self.tok = cfg.generate.group_size, tokenizer

    def generate(self, rollout, problems, step):
        groups = [Group(p.id, [Sample(prompt_id=p.id, prompt_ids=list(p.prompt_ids), step=step,
                                      group_id=f"{step}:{p.id}")
                               for _ in range(p.group_size or self.size)], p)
                  for p in problems]
        for g in groups:
            rollout.add(g)
        rollout.run()  # the model's first turns
        nudge = self.tok(NUDGE)["input_ids"]
        for g in groups:
            again = [s for s in g.samples if s.status == Status.COMPLETED]
            for s in again:
                s.extend(nudge, [0.0] * len(nudge), [-1] * len(nudge), [0.0] * len(nudge),
                         trainable=False)
                s.meta.update(turn_start=s.num_tokens, turn_budget=rollout.params.max_new_tokens)
            rollout.requeue(g, again)
        rollout.run()  # the second turns

    def evaluate(self, engine, prompter, problems, cfg, scorer):
        """Greedy dialogues; a dialogue succeeds when both turns start with the digit."""
        params = SamplingParams(temperature=0.0, max_new_tokens=cfg.generate.max_new_tokens,
                                stop_ids=prompter.stop_ids)
        rollout = Rollout(engine, RunToEnd(), Ledger(), params)
        one = [Problem(p.id, p.prompt, p.answer, prompt_ids=p.prompt_ids, group_size=1)
               for p in prompter.render(list(problems))]
        self.generate(rollout, one, step=0)
        won = [turns_say(self.tok.decode(s.response_ids, skip_special_tokens=True),
                         g.problem.answer) for g in rollout.groups for s in g.samples]
        return {"eval/pass1": sum(won) / len(won), "eval/dialogues": float(len(won))}

    def warm_start_examples(self, cfg, task, tokenizer):
        """Whole dialogues written by the teacher: answer, nudge (not trained), answer."""
        out = []
        for p in task.train:
            prompt = tokenizer(p.prompt)["input_ids"]
            first, nudge = tokenizer(p.answer)["input_ids"], tokenizer(NUDGE)["input_ids"]
            second = tokenizer(p.answer)["input_ids"] + [tokenizer.eos_token_id]
            mask = [1] * len(first) + [0] * len(nudge) + [1] * len(second)
            out.append((prompt + first + nudge + second, len(prompt), mask))
        WARM_CALLS.append(len(out))
        return out


def turns_say(response: str, digit: str) -> bool:
    first, _, second = response.partition(NUDGE)
    return first.strip()[:1] == digit and second.strip()[:1] == digit
