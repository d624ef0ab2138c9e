"""BroRL: the sub-sampled update is unbiased (the mean over every subset equals the whole
group's gradient), the subsets are uniform, and the mass balance matches a softmax bandit
worked by hand."""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups, set_on_policy

import rollwise.training.trainer as trainer_module
from rollwise.config import TrainConfig
from rollwise.training.broad import mass_balance, subsample_rows
from rollwise.training.trainer import Trainer


def test_each_group_keeps_k_rows_uniformly_weighing_n_over_k():
    gi = torch.tensor([0] * 6 + [1] * 2 + [2] * 3)
    counts = Counter()
    for seed in range(3000):
        keep, w = subsample_rows(gi, 2, torch.Generator().manual_seed(seed))
        assert keep[:6].sum() == 2 and keep[6:8].all() and keep[8:].sum() == 2
        assert w[:6][keep[:6]].tolist() == [3.0, 3.0] and w[6:8].tolist() == [1.0, 1.0]
        counts.update(keep.nonzero().flatten().tolist())
    for row in range(6):  # each of six kept with probability 1/3
        assert counts[row] / 3000 == pytest.approx(1 / 3, abs=0.03)
    a = subsample_rows(gi, 2, torch.Generator().manual_seed(5))
    b = subsample_rows(gi, 2, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])


def test_the_mean_update_over_every_subset_is_the_whole_groups(tiny, monkeypatch):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=1, group_size=5, max_new_tokens=5)
    set_on_policy(groups, model, 0, 0)

    def grads(cfg, rows=None):
        if rows is not None:  # the subset under test, as subsample_rows would give it
            monkeypatch.setattr(trainer_module, "subsample_rows", lambda gi, k, gen: (
                torch.tensor([i in rows for i in range(5)]), torch.full((5,), 5 / 2)))
        t = Trainer(copy.deepcopy(model), cfg, pad_id=0, seed=1)
        seen = capture_grads(t)
        t.update(clone(groups))
        return torch.cat([g.flatten() for g in seen[0]])
    base = dict(minibatches=1, warmup_steps=0, grad_clip=1e9)  # clipping is not linear
    full = grads(TrainConfig(**base))
    subsets = list(itertools.combinations(range(5), 2))
    mean = sum(grads(TrainConfig(**base, subsample=2), set(s)) for s in subsets) / len(subsets)
    assert full.abs().max() > 0
    assert torch.allclose(mean, full, atol=1e-6)


def test_mass_balance_on_a_softmax_bandit_worked_by_hand():
    theta = torch.tensor([0.2, -0.1, 0.5, 0.0])
    arms, rewards = [0, 1, 1, 3, 2], [1.0, 0.0, 0.0, 1.0, 0.0]
    trained = torch.tensor([True, True, True, False, False])  # the sub-sample
    pi = torch.softmax(theta, 0)
    adv = [r - sum(rewards) / len(rewards) for r in rewards]
    step = torch.zeros(4)  # REINFORCE on the trained arms: sum A (e_a - pi)
    for a, A, t in zip(arms, adv, trained):
        if t:
            step += A * (torch.nn.functional.one_hot(torch.tensor(a), 4).float() - pi)
    pi2 = torch.softmax(theta + 0.5 * step, 0)
    before = torch.log(pi[arms])[:, None]
    after = torch.log(pi2[arms])[:, None]
    correct = torch.tensor([r >= 1 for r in rewards])
    got = mass_balance(before, after, torch.ones(5, 1), correct, trained)
    want = {
        "mass/sampled_correct_before": float(pi[0]),
        "mass/sampled_correct_delta": float(pi2[0] - pi[0]),
        "mass/sampled_wrong_before": float(pi[1]),
        "mass/sampled_wrong_delta": float(pi2[1] - pi[1]),
        "mass/unsampled_correct_before": float(pi[3]),
        "mass/unsampled_correct_delta": float(pi2[3] - pi[3]),
        "mass/unsampled_wrong_before": float(pi[2]),
        "mass/unsampled_wrong_delta": float(pi2[2] - pi[2])}
    assert got == pytest.approx(want, abs=1e-6)  # float32 exp and log
    assert got["mass/sampled_correct_delta"] > 0 > got["mass/sampled_wrong_delta"]
    assert math.isclose(sum(pi2.tolist()), 1.0, rel_tol=1e-6)


def test_the_trainer_reports_the_mass_balance_from_its_own_passes(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=6, max_new_tokens=5)
    set_on_policy(groups, model, 0, 0)
    cfg = TrainConfig(minibatches=1, warmup_steps=0, subsample=3, mass_balance=True)
    out = Trainer(copy.deepcopy(model), cfg, pad_id=0, seed=1).update(clone(groups))
    assert out["train/dropped_tokens/subsample"] > 0
    samples = [s for g in groups for s in g.samples]
    probs = [math.exp(lp) for s in samples for lp in s.logprobs]
    kinds = {k.split("/")[2].rsplit("_", 1)[0] for k in out if k.startswith("train/mass/")}
    assert kinds == {"sampled_correct", "sampled_wrong", "unsampled_correct", "unsampled_wrong"}
    # the before-figures average the behaviour probabilities (on-policy) of their class
    total = sum(out[f"train/mass/{k}_before"] for k in kinds)
    assert 0 < total <= 4 and min(probs) <= out["train/mass/sampled_correct_before"] <= max(probs)
