"""Filter's group rule (DAPO dynamic sampling: keep groups whose rewards differ, drops counted
by reason), DAPO's soft overlong penalty as the `length` reward channel, and overlong
filtering in the trainer."""

import copy

import pytest
from train_helpers import make_groups, params_equal

from rollwise import models
from rollwise.config import Config, FilterConfig, ModelConfig, TrainConfig
from rollwise.stages.filter.fmt import overlong_penalty
from rollwise.stages.filter.groups import build_group_filter, keep, scored_part, signal
from rollwise.stages.ledger import Ledger
from rollwise.training.trainer import Trainer
from rollwise.types import Group, Problem, Sample, Status


def _sample(reward, n_tokens=3, status=Status.COMPLETED):
    return Sample(prompt_id="p", prompt_ids=[1, 2], response_ids=[5] * n_tokens,
                  logprobs=[-1.0] * n_tokens, versions=[0] * n_tokens,
                  loss_mask=[1] * n_tokens, status=status, reward=reward)


def test_signal_rule_keeps_mixed_groups_and_the_ledger_counts_reasons():
    groups = [Group("a", [_sample(1.0), _sample(0.0)]),
              Group("b", [_sample(1.0), _sample(1.0), _sample(1.0)]),
              Group("c", [_sample(0.0, 4), _sample(0.0, 2)]),
              Group("d", [_sample(0.5)])]
    assert [signal(g) for g in groups] == [(True, ""), (False, "equal_reward"),
                                           (False, "equal_reward"), (False, "single_sample")]

    class Rule:  # a minimal Filter: the signal rule
        def keep(self, g):
            return signal(g)
    ledger = Ledger()
    kept = [g for g in groups if keep(Rule(), g, ledger)]
    assert kept == groups[:1] and kept[0] is groups[0]  # passed through, not copied
    m = ledger.metrics()
    assert m["decisions/filter/drop/equal_reward"] == 2
    assert m["decisions/filter/drop/single_sample"] == 1
    assert m["tokens/filtered/equal_reward"] == 3 * 3 + 6
    assert m["tokens/filtered/single_sample"] == 3


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (5, 0.0), (6, -1 / 3), (7, -2 / 3), (8, -1.0), (9, -1.0)])
def test_soft_overlong_penalty_by_hand(length, expected):
    # L_max = 8, L_cache = 3: free up to 5 tokens, then linear to -1 at 8, -1 beyond
    assert overlong_penalty(length, 8, 3) == pytest.approx(expected)
    assert overlong_penalty(length, 8, 0) == (-1.0 if length > 8 else 0.0)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "1"


def test_the_length_channel_splits_a_group_that_ties_on_raw_reward():
    task = type("T", (), {"extract_answer": staticmethod(lambda t: t.strip()),
                          "score_fn": None})()
    problem = Problem("p", "1+0=", "1")
    group = Group("p", [_sample(0.0, 2), _sample(0.0, 8)], problem)
    plain = build_group_filter(Config(filter=FilterConfig(workers=0)), task, _Tok())
    plain.score([group])
    assert [s.reward for s in group.samples] == [1.0, 1.0] and not plain.keep(group)[0]
    cfg = Config(filter=FilterConfig(reward={"exact": 1.0, "length": 0.5}, length_max=8,
                                     length_buffer=3, workers=0))
    shaped = build_group_filter(cfg, task, _Tok())
    shaped.score([group])
    assert [s.reward for s in group.samples] == [1.0, 0.5]  # 1 + 0.5 * -1 at L_max
    assert group.samples[1].rewards == {"exact": 1.0, "length": -1.0}
    assert shaped.keep(group) == (True, "")


def test_the_overlong_keys_moved_to_the_filter_with_a_clear_error():
    with pytest.raises(ValueError, match="length channel.*filter.length_max"):
        TrainConfig(overlong_buffer=2, overlong_max_length=8)


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


def test_the_trainer_takes_filter_rewards_as_they_are(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=4)
    trainer = Trainer(copy.deepcopy(model), TrainConfig(), pad_id=tok.pad_token_id)
    samples = [s for g in groups for s in g.samples]
    for s in samples:  # what a length channel weighted 1 would have added
        s.reward += overlong_penalty(s.num_tokens, 4, 2)
    assert any(s.num_tokens > 2 for s in samples)  # the penalty is not all zeros
    expected = [s.reward for s in samples]
    assert trainer.rewards(samples).tolist() == pytest.approx(expected)
    m = trainer.update(groups)
    assert m["train/reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)


def test_an_unscored_sample_leaves_its_group_and_is_counted():
    """A sample no verifier could score is left out of what is trained and of the group's
    statistics (its reward 0 is no reward); a group it leaves with one scored sample is dropped."""
    failed = _sample(0.0, 5, Status.FAILED)
    mixed_only_by_failure = Group("a", [_sample(1.0), _sample(1.0), failed])
    assert not mixed_only_by_failure.is_mixed  # 1, 1 and an unscored 0: no signal

    class Rule:
        def keep(self, g):
            return signal(g)
    ledger = Ledger()
    part = scored_part(mixed_only_by_failure, ledger)
    assert part.samples == mixed_only_by_failure.samples[:2] and failed not in part.samples
    assert mixed_only_by_failure.samples[2] is failed  # the stored group keeps it
    assert not keep(Rule(), part, ledger)  # equal rewards among the scored ones
    lone = scored_part(Group("b", [_sample(1.0), _sample(0.0, 2, Status.FAILED)]), ledger)
    assert not keep(KeepAll(), lone, ledger)  # even a rule that keeps everything
    assert not keep(KeepAll(), scored_part(Group("c", [failed]), ledger), ledger)
    single = Group("d", [_sample(1.0)])  # a group of one, all scored: the rule decides
    assert keep(KeepAll(), scored_part(single, ledger), ledger)
    m = ledger.metrics()
    assert m["decisions/filter/unscored/verifier_failed"] == 3
    assert m["tokens/unscored"] == 5 + 2 + 5
    assert m["decisions/filter/drop/too_few_scored"] == 2
    assert m["decisions/filter/drop/equal_reward"] == 1


class KeepAll:
    def keep(self, g):
        return True, ""


def test_the_trainer_refuses_an_unscored_sample():
    groups = [Group("a", [_sample(1.0), _sample(0.0, 3, Status.FAILED)])]
    trainer = Trainer(build_tiny(), TrainConfig(), pad_id=0)
    with pytest.raises(RuntimeError, match="no verifier could score reached the trainer"):
        trainer.update(groups)


def build_tiny():
    return models.build(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=32), seed=0)[0]
