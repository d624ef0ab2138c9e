"""D³S: the sample subset against brute force, the token selection against a sort, the
schedule, and an update whose left-out samples and tokens are as if never generated."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups

from rollwise.config import TrainConfig
from rollwise.training.downsample import (
    keep_fraction,
    max_variance_subset,
    sample_keep,
    token_keep,
)
from rollwise.training.trainer import Trainer


def _var(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


@pytest.mark.parametrize("seed", range(30))
def test_the_subset_has_the_largest_advantage_variance_of_all_subsets(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    values = [rng.choice([rng.gauss(0, 1), 1.0, -1.0, 0.0]) for _ in range(n)]
    m = rng.randint(2, n)
    got = max_variance_subset(values, m)
    assert len(got) == m and got == sorted(set(got))
    best = max(_var([values[i] for i in c]) for c in itertools.combinations(range(n), m))
    assert _var([values[i] for i in got]) == pytest.approx(best, abs=1e-12)


def test_a_binary_group_keeps_a_balanced_subset_and_every_group_is_kept():
    adv = torch.tensor([1.0, -0.5, -0.5, -0.5, -0.5, -0.5, 1.0, 1.0, 0.3, -0.3])
    groups = torch.tensor([0] * 8 + [1] * 2)
    keep = sample_keep(adv, groups, 0.5)
    assert keep[:8].sum() == 4 and adv[:8][keep[:8]].tolist().count(1.0) == 2
    assert keep[8:].all()  # at least 2 of a group


def test_tokens_with_the_largest_abs_advantage_times_entropy_are_kept():
    torch.manual_seed(0)
    adv = torch.randn(4, 1).expand(4, 6)
    ent = torch.rand(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    got = token_keep(adv, ent, mask, 0.4)
    cells = [(float(adv[i, t].abs() * ent[i, t]), i * 6 + t) for i in range(4) for t in range(6)
             if mask[i, t] > 0]
    k = round(0.4 * len(cells))
    want = {pos for _, pos in sorted(cells, key=lambda c: (-c[0], c[1]))[:k]}
    assert {int(p) for p in got.flatten().nonzero().flatten()} == want
    assert float(token_keep(adv, ent, mask, 0.0).sum()) == 0


def test_the_schedule_starts_aggressive_and_relaxes_to_everything():
    assert keep_fraction(0, 0.5, 100) == 0.5
    assert keep_fraction(50, 0.5, 100) == 0.75
    assert keep_fraction(100, 0.5, 100) == keep_fraction(400, 0.5, 100) == 1.0
    assert keep_fraction(0, 0.5, 0) == 1.0


def test_left_out_samples_and_tokens_train_as_if_never_generated(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=6, max_new_tokens=6)
    cfg = TrainConfig(minibatches=1, warmup_steps=0, downsample="d3s")
    d3s = Trainer(copy.deepcopy(model), cfg, pad_id=0, seed=1)
    prep, m = d3s.prepare(clone(groups))
    plain_prep, _ = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, warmup_steps=0),
                            pad_id=0, seed=1).prepare(clone(groups))
    kept = prep.mask
    assert m["dropped_tokens/d3s_sample"] > 0 and m["dropped_tokens/d3s_token"] > 0
    assert m["dropped_tokens/d3s_sample"] + m["dropped_tokens/d3s_token"] == \
        float(plain_prep.mask.sum() - kept.sum())
    # the same update with the left-out tokens masked in the samples themselves
    masked = clone(groups)
    for i, s in enumerate(s for g in masked for s in g.samples):
        p = len(s.prompt_ids)
        s.loss_mask = [int(kept[i, p - 1 + t] > 0) for t in range(s.num_tokens)]
    plain = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, warmup_steps=0), pad_id=0,
                    seed=1)
    seen_d3s, seen_plain = capture_grads(d3s), capture_grads(plain)
    d3s.update(clone(groups))
    plain.update(masked)
    a = torch.cat([g.flatten() for g in seen_d3s[0]])
    b = torch.cat([g.flatten() for g in seen_plain[0]])
    assert a.abs().max() > 0 and torch.allclose(a, b, atol=1e-6)
