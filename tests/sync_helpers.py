"""Shared by tests/test_sync_*.py: one round of real rollouts from an engine, as groups."""

import time

from transformers import Qwen2ForCausalLM

from rollwise.engine import Request, SamplingParams
from rollwise.types import Group, Sample

PROMPTS = ["12+34=", "7-5=", "101+9=", "3+3="]


def rl_groups(engine, tok, seed: int | None = None, group_size: int = 4) -> list[Group]:
    """Reward 1 when the response starts with an even token id: a verifier a random tiny model
    satisfies sometimes, so groups have mixed rewards. `seed` fixes every request's stream
    (else the engine's own seeded stream decides)."""
    reqs = [Request(tok(p)["input_ids"],
                    SamplingParams(max_new_tokens=5,
                                   seed=None if seed is None else seed + i * group_size + j),
                    i)
            for i, p in enumerate(PROMPTS) for j in range(group_size)]
    groups: dict[int, list[Sample]] = {}
    for r, c in zip(reqs, engine.generate(reqs)):
        s = Sample(prompt_id=str(r.id), prompt_ids=r.prompt_ids, response_ids=c.token_ids,
                   logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.token_ids))
        s.reward = float(c.token_ids[0] % 2 == 0)
        groups.setdefault(r.id, []).append(s)
    return [Group(str(k), v) for k, v in groups.items()]


class HangingModel(Qwen2ForCausalLM):
    """A model whose construction never finishes: an engine child that is alive but never
    says it is up (module level, so a spawned child can unpickle it)."""

    def __init__(self, config):
        time.sleep(3600)
