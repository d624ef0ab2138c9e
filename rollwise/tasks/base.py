"""What a task is: `train` and `eval` lists of Problem and `extract_answer(response)`, with
defaults for what only some tasks have. Subclass `Task` (a plugin object that does not gets
the same defaults from rollwise.registry.conform when it is loaded)."""

from __future__ import annotations

import abc
import random
from typing import Any, Callable

from rollwise.types import Problem


class Task(abc.ABC):
    train: list[Problem]
    eval: list[Problem]
    score_fn: Callable[[str, Problem], float] | None = None
    """The task's own scorer (reasoning-gym's); None scores with the configured verifier."""
    plain_prompts = False
    """Prompts in the task's own format: no chat template under task.chat_template=auto."""
    played_as = "responses"
    """What a sample of it must be: 'responses' (any generator), or what a generator
    `produces` ('episodes': agent turns with an environment, and the task gives the warm
    start's turns as worked_actions(problem, rng, noisy); 'packs': Connect-the-Dots, with
    teacher_answer and teacher_hint)."""

    @abc.abstractmethod
    def extract_answer(self, response: str) -> str | None:
        """The string the verifier compares with the problem's answer (None: no answer)."""

    def worked_solution(self, problem: Problem, rng: random.Random, noisy: bool) -> str:
        """The response the warm start trains on (noisy: a deliberately flawed one)."""
        return problem.solution


def draw_unique(n: int, draw: Callable[[int], Problem], exclude: set[str], split: str,
                what: str) -> list[Problem]:
    """n problems from draw(index), none whose prompt is in `exclude`; eval prompts are unique
    and join it (train may repeat, never an eval prompt). Built-in tasks draw with it."""
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"{what} has too few distinct problems for {n} {split} prompts; "
                             "lower task.eval_size")
        p = draw(len(out))
        if p.prompt in exclude:
            continue
        if split == "eval":
            exclude.add(p.prompt)
        out.append(p)
    return out


def solution_examples(task: Task, tokenizer, noise: float | dict[str, float], seed: int,
                      encode: Callable[[Any], list[int]] | None = None,
                      stop_id: int | None = None) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) for every train problem with a worked solution; `noise` is
    one share for every tier or a share per tier (a tier left out is clean). encode(prompt):
    the prompt's ids as the run renders them (a chat model's template; default: plain text);
    stop_id ends each response (default: the tokenizer's eos)."""
    if isinstance(noise, dict):
        unknown = set(noise) - {p.tier for p in task.train}
        if unknown:
            raise ValueError(f"sft.noise names tier(s) {sorted(unknown)} that the task's train "
                             f"set does not have; use tiers of task.tiers")
    rng = random.Random(seed)
    out = []
    for p in task.train:
        if p.solution is None:
            continue
        share = noise.get(p.tier, 0.0) if isinstance(noise, dict) else noise
        solution = task.worked_solution(p, rng, noisy=share > 0 and rng.random() < share)
        prompt = encode(p.prompt) if encode else tokenizer(p.prompt)["input_ids"]
        stop = tokenizer.eos_token_id if stop_id is None else stop_id
        out.append((prompt + tokenizer(solution, add_special_tokens=False)["input_ids"] + [stop],
                    len(prompt)))
    if not out:
        raise ValueError("the task has no worked solutions to warm-start from; "
                         "pass run.init=<model folder> instead")
    return out
