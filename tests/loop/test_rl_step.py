"""Engine/trainer agreement and one real RL step on a tiny model (hand-computed advantage and
loss values are in tests/test_train_*.py)."""

import torch

from rollwise.config import TrainConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch, Group, Sample


def _samples(tiny, n=6, seed=3):
    model, tok = tiny
    engine = BuiltinEngine(model, seed=seed)
    prompts = ["12+34=", "  7-5=", "101+9="]
    reqs = [Request(tok(p)["input_ids"], SamplingParams(max_new_tokens=6), i)
            for i, p in enumerate(prompts * (n // 3))]
    out = []
    for r, c in zip(reqs, engine.generate(reqs)):
        s = Sample(prompt_id=str(r.id % 3), prompt_ids=r.prompt_ids, response_ids=c.token_ids,
                   logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.token_ids))
        out.append(s)
    return out


def test_engine_logprobs_equal_trainer_full_forward(tiny):
    model, tok = tiny
    samples = _samples(tiny)
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    gap = ((logp - batch.behaviour_logprobs).abs() * batch.loss_mask).max()
    assert gap < 1e-4
    assert batch.loss_mask.sum() == sum(len(s.response_ids) for s in samples)


def test_one_rl_step_raises_the_rewarded_sample(tiny):
    model, tok = tiny
    model = __import__("copy").deepcopy(model)
    samples = _samples((model, tok), n=6)
    group = Group("g", samples[:4])
    for i, s in enumerate(group.samples):
        s.reward = 1.0 if i == 0 else 0.0
    trainer = Trainer(model, TrainConfig(lr=1e-2, minibatches=1), pad_id=tok.pad_token_id)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = Batch.from_samples(group.samples, [0.0] * 4, tok.pad_token_id)
    with torch.no_grad():
        lp0 = (token_logprobs(model, batch)[0] * batch.loss_mask).sum(-1)
    metrics = trainer.update([group])
    with torch.no_grad():
        lp1 = (token_logprobs(model, batch)[0] * batch.loss_mask).sum(-1)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert lp1[0] > lp0[0]  # the rewarded sample became more likely
    assert (lp1[1:] - lp0[1:]).mean() < 0  # the unrewarded ones less likely, on average
    assert trainer.version == 1 and metrics["train/samples"] == 4
