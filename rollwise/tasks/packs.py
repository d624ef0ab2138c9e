"""Connect-the-Dots packs (docs/methods.md#cod; task.name=packs, configs/packs.yaml): K related
tasks that share a hidden rule, solved one after another by a model that carries what it
learned from one task to the next only in a hint it writes itself.

The built-in packs remap an operator: in one pack `a#b` means a+b, in another a-b or a*b
(one-digit operands, a >= b). Each train pack holds 4 tasks, each eval pack 8. The pack
environment `remap` (registry kind 'pack', rollwise.agents.pack_play) writes the episodes' texts:

    solve:   "hint:<hint>;7#3="                      -> "10"
    update:  "hint:<hint>;7#3=10;ok;7#3=10;new:"     -> "plus"   (the next hint)

A solve episode earns 1 for the right number. An update sees its hint, the task, the model's
answer, whether it was right and the true equation, and writes the next hint; its own reward
is only a length penalty (-0.1 for an empty hint, growing past 8 characters): a hint is worth
what the later tasks earn with it (CoD's rewards-to-go).

The warm start's teacher solves with the rule its hint names (a guessed rule without one) and
writes as the next hint a rule the true equation fits (keeping its hint when that fits too). A
lazy teacher (sft.noise of its updates) writes no hint, so the warm start mostly forgets what
it saw, and what a hint is worth is left for RL to learn from the later tasks' rewards.
"""

from __future__ import annotations

import random

from rollwise.config import TaskConfig
from rollwise.tasks.base import Task
from rollwise.types import Problem

RULES = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
TRAIN_SIZE, EVAL_SIZE = 4, 8  # tasks per pack (CoD: 4 in training, 8 in evaluation)
MAX_HINT = 8  # characters a hint may have without penalty


class PacksTask(Task):
    plain_prompts = True
    played_as = "packs"  # played by generate.strategy=cod

    def __init__(self, cfg: TaskConfig):
        rng = random.Random(cfg.seed)
        self.train = [self._pack(f"train-{i}", TRAIN_SIZE, rng) for i in range(cfg.train_size)]
        self.eval = [self._pack(f"eval-{i}", EVAL_SIZE, rng) for i in range(cfg.eval_size)]

    @staticmethod
    def _pack(pid: str, size: int, rng: random.Random) -> Problem:
        rule = rng.choice(sorted(RULES))
        items = []
        for _ in range(size):
            a = rng.randint(2, 9)
            items.append([a, rng.randint(1, a)])
        return Problem(id=pid, prompt=f"pack of {size}", answer=rule, tier=rule,
                       data={"rule": rule, "items": items})

    def extract_answer(self, response: str) -> str | None:
        return response.strip() or None

    # ---- the warm start's teacher (rollwise.agents.pack_play.pack_examples) -------------------
    def teacher_answer(self, problem: Problem, i: int, hint: str, rng: random.Random) -> str:
        """The answer by the rule the hint names, else by a guessed rule."""
        rule = hint if hint in RULES else rng.choice(sorted(RULES))
        a, b = problem.data["items"][i]
        return str(RULES[rule](a, b))

    def teacher_hint(self, problem: Problem, i: int, hint: str, rng: random.Random,
                     noisy: bool) -> str:
        """A rule the true equation of task i fits (the old hint when it fits); a noisy
        teacher writes no hint at all."""
        if noisy:
            return ""
        a, b = problem.data["items"][i]
        truth = RULES[problem.data["rule"]](a, b)
        fits = [r for r in sorted(RULES) if RULES[r](a, b) == truth]
        return hint if hint in fits else rng.choice(fits)


class RemapPack:
    """The pack environment of PacksTask problems (rollwise.agents.pack_play.PackEnvironment)."""

    def __init__(self, cfg, problem: Problem):
        self.rule = RULES[problem.data["rule"]]
        self.items = problem.data["items"]
        self.size = len(self.items)

    def task_prompt(self, i: int, hint: str) -> str:
        a, b = self.items[i]
        return f"hint:{hint};{a}#{b}="

    def score_task(self, i: int, response: str) -> tuple[float, str]:
        a, b = self.items[i]
        truth = self.rule(a, b)
        ok = response.strip() == str(truth)
        return float(ok), f"{'ok' if ok else 'no'};{a}#{b}={truth}"

    def update_prompt(self, i: int, hint: str, response: str, feedback: str) -> str:
        a, b = self.items[i]
        answer = "".join(c for c in response if c.isdigit() or c == "-")[:4]
        return f"hint:{hint};{a}#{b}={answer};{feedback};new:"

    def hint_reward(self, hint: str) -> float:
        if not hint:
            return -0.1
        return -0.1 * min(1.0, max(0, len(hint) - MAX_HINT) / MAX_HINT)
