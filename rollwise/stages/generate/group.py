"""i.i.d. groups: G independent samples per prompt (the GRPO default, generate.strategy=group);
G is the prompt's own size when Control set one (Problem.group_size), else generate.group_size."""

from __future__ import annotations

from rollwise.engine import SamplingParams
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.rollout import Rollout
from rollwise.types import Group, Problem, Sample


def sampling_params(cfg, stop_ids: tuple[int, ...]) -> SamplingParams:
    """cfg: GenerateConfig; stop_ids: the Prompter's (eos and the end-of-turn token)."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop_ids=tuple(stop_ids))


def new_sample(problem: Problem, prompt_ids: list[int], step: int) -> Sample:
    return Sample(prompt_id=problem.id, prompt_ids=list(prompt_ids),
                  group_id=f"{step}:{problem.id}", step=step,
                  meta={"tier": problem.tier, "answer": problem.answer})


class GroupGenerator(Generator):
    def __init__(self, cfg, tokenizer):
        """cfg: the run's Config."""
        self.group_size, self.tokenizer = cfg.generate.group_size, tokenizer

    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        for p in problems:  # prompt_ids: rendered once by the Prompter (rollwise.tasks.prompts)
            rollout.add(Group(p.id, [new_sample(p, p.prompt_ids, step)
                                     for _ in range(p.group_size or self.group_size)], p))
        rollout.run()
