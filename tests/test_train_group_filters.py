"""DAPO dynamic sampling, overlong filtering and the soft overlong penalty."""

import copy

import pytest

from rollwise.config import TrainConfig
from rollwise.train.group_filters import (dynamic_sampling, overlong_keep, shaped_reward,
                                          soft_overlong_penalty)
from rollwise.train.trainer import Trainer
from rollwise.types import Group, Sample, Status
from train_helpers import make_groups, params_equal


def _sample(reward, n_tokens=3, status=Status.COMPLETED):
    return Sample(prompt_id="p", prompt_ids=[1, 2], response_ids=[5] * n_tokens,
                  logprobs=[-1.0] * n_tokens, versions=[0] * n_tokens,
                  loss_mask=[1] * n_tokens, status=status, reward=reward)


def test_dynamic_sampling_keeps_mixed_groups_and_counts_reasons():
    groups = [Group("a", [_sample(1.0), _sample(0.0)]),
              Group("b", [_sample(1.0), _sample(1.0), _sample(1.0)]),
              Group("c", [_sample(0.0, 4), _sample(0.0, 2)]),
              Group("d", [_sample(0.5)])]
    kept, m = dynamic_sampling(groups)
    assert [g.prompt_id for g in kept] == ["a"]
    assert m["filter/groups_in"] == 4 and m["filter/groups_kept"] == 1
    assert m["filter/dropped/equal_reward"] == 2 and m["filter/dropped/single_sample"] == 1
    assert m["filter/dropped_samples"] == 6 and m["filter/dropped_tokens"] == 3 * 3 + 6 + 3
    assert kept[0] is groups[0]  # groups are passed through, not copied


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (5, 0.0), (6, -1 / 3), (7, -2 / 3), (8, -1.0), (9, -1.0)])
def test_soft_overlong_penalty_by_hand(length, expected):
    # L_max = 8, L_cache = 3: free up to 5 tokens, then linear to -1 at 8, -1 beyond
    assert soft_overlong_penalty(length, 8, 3) == pytest.approx(expected)
    assert soft_overlong_penalty(length, 8, 3, factor=0.5) == pytest.approx(expected / 2)
    assert soft_overlong_penalty(length, 8, 0) == 0.0


def test_soft_penalty_splits_a_group_that_ties_on_raw_reward():
    cfg = TrainConfig(overlong_buffer=3, overlong_max_length=8)
    group = Group("a", [_sample(1.0, 2), _sample(1.0, 8)])
    assert shaped_reward(group.samples[1], cfg) == 0.0
    assert dynamic_sampling([group])[0] == []
    assert len(dynamic_sampling([group], cfg)[0]) == 1
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(3, 2, 5)


def test_overlong_keep_marks_truncated_samples():
    ss = [_sample(1.0), _sample(0.0, status=Status.TRUNCATED), _sample(0.0)]
    assert overlong_keep(ss) == [True, False, True]


def test_overlong_filter_equals_masking_the_truncated_samples_by_hand(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=3)
    for g in groups:  # the random model rarely stops: mark which ones were cut
        for j, s in enumerate(g.samples):
            s.status = Status.TRUNCATED if j in (1, 2) else Status.COMPLETED
    truncated = [s for g in groups for s in g.samples if s.status == Status.TRUNCATED]
    by_hand = copy.deepcopy(groups)
    for g in by_hand:
        for s in g.samples:
            if s.status == Status.TRUNCATED:
                s.loss_mask = [0] * s.num_tokens
    m_filter, m_hand = copy.deepcopy(model), copy.deepcopy(model)
    out = Trainer(m_filter, TrainConfig(lr=1e-2, overlong_filter=True),
                  pad_id=tok.pad_token_id).update(groups)
    Trainer(m_hand, TrainConfig(lr=1e-2), pad_id=tok.pad_token_id).update(by_hand)
    assert out["train/dropped_tokens/overlong"] == sum(s.num_tokens for s in truncated)
    assert params_equal(m_filter, m_hand, atol=1e-7)


def test_soft_penalty_reaches_the_trainer_rewards(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=4)
    cfg = TrainConfig(overlong_buffer=2, overlong_max_length=4)
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    samples = [s for g in groups for s in g.samples]
    expected = [s.reward + soft_overlong_penalty(s.num_tokens, 4, 2) for s in samples]
    assert trainer.rewards(samples).tolist() == pytest.approx(expected)
    assert any(s.num_tokens > 2 for s in samples)  # the penalty is not all zeros
    m = trainer.update(groups)
    assert m["train/reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
