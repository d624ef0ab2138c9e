"""i.i.d. groups: G independent samples per prompt, generated in one engine call."""

from __future__ import annotations

from rollwise.engine import Completion, Request, SamplingParams
from rollwise.tasks import Problem
from rollwise.types import Group, Sample, Status


def sampling_params(cfg, eos_id: int) -> SamplingParams:
    """cfg: GenerateConfig."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop_ids=(eos_id,))


def new_sample(problem: Problem, prompt_ids: list[int], step: int) -> Sample:
    return Sample(prompt_id=problem.id, prompt_ids=list(prompt_ids),
                  group_id=f"{step}:{problem.id}", step=step,
                  meta={"tier": problem.tier, "answer": problem.answer})


def extend(sample: Sample, c: Completion) -> Sample:
    """Append a completion's tokens (all trainable) and set the sample's status from it."""
    sample.response_ids += c.token_ids
    sample.logprobs += c.logprobs
    sample.versions += c.versions
    sample.entropies += c.entropies
    sample.loss_mask += [1] * len(c.token_ids)
    sample.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED,
                     "abort": Status.ABORTED, "paused": Status.PAUSED}[c.finish_reason]
    return sample


class GroupGenerator:
    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.params = sampling_params(cfg, tokenizer.eos_token_id)

    def generate(self, engine, problems: list[Problem], step: int) -> list[Group]:
        g = self.cfg.group_size
        prompts = [self.tokenizer(p.prompt)["input_ids"] for p in problems]
        requests = [Request(prompts[i], self.params, i * g + j)
                    for i in range(len(problems)) for j in range(g)]
        samples = [extend(new_sample(problems[r.id // g], r.prompt_ids, step), c)
                   for r, c in zip(requests, engine.generate(requests))]
        return [Group(p.id, samples[i * g:(i + 1) * g], p) for i, p in enumerate(problems)]
