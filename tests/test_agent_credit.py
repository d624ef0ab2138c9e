"""Connect-the-Dots credit assignment (rollwise/training/cod.py, the rec_oneside loss) and
TRACE's allocation (rollwise/agents/trace.py) on hand-computed examples."""

import math

import pytest
import torch

from rollwise.agents.trace import (PrefixPredictor, allocate, mixed_probability,
                                   sibling_advantages)
from rollwise.training.cod import baseline_advantages, red_reweight, reward_to_go
from rollwise.training.losses import LossParams, rec_oneside


def test_cod_rewards_to_go():
    solve, hint = reward_to_go([1.0, 0.0, 1.0, 1.0], [-0.1, 0.0, -0.2])
    assert solve == pytest.approx([3 / 4, 2 / 3, 1.0, 1.0])
    # hint j: its own reward and the tasks after it, j + 1 .. K - 1
    assert hint == pytest.approx([(-0.1 + 2) / 4, 2 / 3, (-0.2 + 1) / 2])
    with pytest.raises(ValueError, match="a hint follows a task"):
        reward_to_go([1.0], [0.0, 0.0])


def test_cod_baselines_are_kept_per_pack_type_and_index():
    records = [(("p1", "solve", 0), 1.0), (("p1", "solve", 0), 0.0),
               (("p1", "solve", 1), 0.5), (("p1", "hint", 0), 0.25),
               (("p2", "solve", 0), 0.25), (("p1", "hint", 0), 0.75)]
    assert baseline_advantages(records) == pytest.approx([0.5, -0.5, 0.0, -0.25, 0.0, 0.25])


def test_red_reweighting_finds_the_largest_temperature_with_a_nonnegative_sum():
    same, t = red_reweight([1.0, -0.5], [1, 1])
    assert t is None and same == [1.0, -0.5]
    # 1 * e^{1/T} - 3 * e^{-1/T} >= 0  <=>  T <= 2 / ln 3
    adv, t = red_reweight([1.0, -1.0], [1, 3])
    assert t == pytest.approx(2 / math.log(3), abs=1e-6)
    assert adv == pytest.approx([math.exp(1 / t), -math.exp(-1 / t)])
    assert 1 * adv[0] + 3 * adv[1] >= 0
    _, t = red_reweight([0.1, -1.0], [1, 100])  # out of reach: the lowest temperature
    assert t == 0.8


def test_rec_oneside_drops_only_tokens_outside_on_their_side():
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logp = ratio.log().clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = rec_oneside(logp, old, adv, torch.ones(1, 4), LossParams(0.2, 0.2))
    loss.sum().backward()
    # A > 0 above 1 + eps and A < 0 below 1 - eps: no gradient; the rest -A, no IS weight
    assert logp.grad.tolist() == [[0.0, -1.0, 0.0, 1.0]]
    assert m["clip_frac"] == 0.5


def test_trace_allocation_on_a_constructed_predictor():
    assert mixed_probability(0.5, 2) == 0.5 and mixed_probability(0.5, 3) == 0.75
    assert mixed_probability(0.3, 1) == 0.0
    # gains: anchor 0 (p = .5) 0.25, 0.25, 0.125, 0.0625; anchor 1 (p = .9) 0.09 per pair
    assert allocate([0.5, 0.9, 0.0, 1.0], 6) == [4, 2, 0, 0]
    assert allocate([0.0, 1.0], 10) == [0, 0]  # certain anchors: nothing to learn there
    assert allocate([0.5, 0.5], 3, max_per_anchor=2) == [2, 0]


def test_trace_advantages_among_siblings():
    adv = sibling_advantages([1.0, 0.0, 1.0, 1.0, 0.0], ["a", "a", "b", "b", "c"])
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0])


def test_prefix_predictor_learns_success_from_features():
    x = torch.tensor([[0.0], [1.0]] * 50)
    y = x[:, 0]
    pred = PrefixPredictor(1, lr=1.0)
    pred.update(x, y, steps=300)
    p = pred.predict(torch.tensor([[0.0], [1.0]]))
    assert p[0] < 0.1 and p[1] > 0.9
