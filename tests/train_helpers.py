"""Shared fixtures for tests/test_train_*.py: real samples from the tiny model."""

from __future__ import annotations

import copy
import random

import torch

from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.training.head import chunk_tokens
from rollwise.training.packing import pack, packed_token_logprobs, worth_packing
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch, Group, Sample, Status

PROMPTS = ["12+34=", "  7-5=", "101+9=", "55-12=", "3+4=", "90-9="]


def make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=5, seed=0,
                version=0) -> list[Group]:
    """Groups sampled by the engine from `model`, with seeded mixed binary rewards."""
    engine = BuiltinEngine(model, seed=seed, version=version)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_ids=(tok.eos_token_id,))
    reqs = [Request(tok(p)["input_ids"], params, i)
            for i, p in enumerate(PROMPTS[:n_prompts]) for _ in range(group_size)]
    rng = random.Random(seed)
    groups: dict[int, list[Sample]] = {}
    for r, c in zip(reqs, engine.generate(reqs)):
        s = Sample(prompt_id=str(r.id), prompt_ids=list(r.prompt_ids),
                   response_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                   loss_mask=[1] * len(c.token_ids), entropies=c.entropies,
                   status=Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED)
        groups.setdefault(r.id, []).append(s)
    out = [Group(str(k), v) for k, v in groups.items()]
    for g in out:
        for j, s in enumerate(g.samples):  # first sample right, second wrong, rest random
            s.reward = 1.0 if j == 0 else 0.0 if j == 1 else float(rng.random() < 0.5)
            s.rewards = {"reward": s.reward, "short": float(s.num_tokens <= 3)}
    return out


def set_on_policy(groups: list[Group], model, pad_id: int, version: int) -> None:
    """Make behaviour = the trainer's own log-probabilities, exactly, at `version`."""
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id)
    chunk = chunk_tokens(model.config.vocab_size)  # train.chunked_logits, default
    with torch.no_grad():  # the way the trainer computes them (train.pack_prompts, default)
        packed = pack(batch)
        logp = (packed_token_logprobs(model, batch, packed, chunk=chunk)[0]
                if worth_packing(batch, packed) else token_logprobs(model, batch, chunk=chunk)[0])
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), s.num_tokens
        s.logprobs = logp[i, p - 1:p - 1 + n].tolist()
        s.versions = [version] * n


def capture_grads(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Record the gradients each optimizer step sees (before it applies them)."""
    seen: list[list[torch.Tensor]] = []

    def record(optimizer, args, kwargs):
        seen.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                     for p in trainer.params()])
    trainer.optimizer.register_step_pre_hook(record)
    return seen


def clone(groups: list[Group]) -> list[Group]:
    return copy.deepcopy(groups)


def params_equal(a, b, atol=0.0) -> bool:
    return all(torch.allclose(p, q, atol=atol, rtol=0) for p, q in
               zip(a.parameters(), b.parameters()))


def random_samples(seed: int, prompts: int = 5, vocab=(3, 50)) -> list[Sample]:
    """Groups of 1-6 samples sharing a random prompt; responses of 0-7 tokens; shuffled."""
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(*vocab) for _ in range(rng.randint(1, 12))]
        for _ in range(rng.randint(1, 6)):
            resp = [rng.randrange(*vocab) for _ in range(rng.randint(0, 7))]
            out.append(Sample(prompt_id=str(g), prompt_ids=prompt, response_ids=resp,
                              logprobs=[0.0] * len(resp), versions=[0] * len(resp),
                              loss_mask=[1] * len(resp)))
    rng.shuffle(out)
    return out
