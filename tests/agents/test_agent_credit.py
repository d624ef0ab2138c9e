"""Connect-the-Dots credit assignment (rollwise/training/cod.py, the rec_oneside loss) and
TRACE's allocation (rollwise/agents/trace.py) on hand-computed examples."""

import math

import pytest
import torch

from rollwise.agents.trace import PrefixPredictor, allocate, mixed_probability
from rollwise.training.cod import baseline_advantages, red_reweight, reward_to_go
from rollwise.training.losses import LossParams, rec_oneside
from rollwise.training.tree_credit import sibling_advantages


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


def test_trace_allocation_in_tokens_weighs_each_gain_by_its_cost():
    # per token, anchor 0 (1 token a continuation): 0.25, 0.25, 0.125, 0.0625; anchor 1 (2
    # tokens): 0.125 for its first pair, which wins over anchor 0's fifth once tied gains go
    # to the first anchor
    assert allocate([0.5, 0.5], 8, costs=[1, 2]) == [4, 2]
    # equal costs allocate as continuations do, scaled
    assert allocate([0.5, 0.9, 0.0, 1.0], 18, costs=[3] * 4) == [4, 2, 0, 0]
    # nothing that does not fit: a 5-token pair in a 9-token budget, then one more
    assert allocate([0.5], 9, costs=[5]) == [0]
    assert allocate([0.5], 15, costs=[5]) == [3]


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


def test_cod_advantage_estimator_in_the_trainer(tiny):
    """train.advantage=cod: per-slot baselines over the samples' rewards-to-go, then RED by
    trained tokens, as the trainer computes them for a batch."""
    import copy

    from train_helpers import make_groups

    from rollwise.config import TrainConfig
    from rollwise.training.advantages import AdvantageInputs, compute_advantages
    from rollwise.training.trainer import Trainer
    meta = [{"cod_key": ("p1", "solve", 0), "cod_return": 1.0},
            {"cod_key": ("p1", "solve", 0), "cod_return": 0.0},
            {"cod_key": ("p1", "hint", 0), "cod_return": 0.5},
            {"cod_key": ("p1", "hint", 0), "cod_return": 0.5}]
    x = AdvantageInputs(torch.zeros(4), torch.zeros(4, dtype=torch.long), meta=meta,
                        tokens=torch.tensor([2.0, 6.0, 1.0, 1.0]))
    out = compute_advantages("cod", x)
    # baselines: [0.5, -0.5, 0, 0]; token sum 1 - 3 < 0; RED: e^{1/T} >= 3 -> T = 1 / ln 3
    t = 1 / math.log(3)
    assert out.metrics["red_temperature"] == pytest.approx(t, abs=1e-6)
    assert out.advantages.tolist() == pytest.approx(
        [0.5 * math.exp(0.5 / t), -0.5 * math.exp(-0.5 / t), 0.0, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="cod_key"):
        compute_advantages("cod", AdvantageInputs(torch.zeros(1), torch.zeros(1).long(),
                                                  meta=[{}]))
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    groups = make_groups(model, tok, n_prompts=1, group_size=4, seed=3)
    for s, m in zip(groups[0].samples, meta):
        s.meta.update(m)
    trainer = Trainer(model, TrainConfig(advantage="cod"), pad_id=tok.pad_token_id)
    prep, _ = trainer.prepare(groups)
    tokens = torch.tensor([float(sum(s.loss_mask)) for s in groups[0].samples])
    want = compute_advantages("cod", AdvantageInputs(torch.zeros(4), torch.zeros(4).long(),
                                                     meta=meta, tokens=tokens)).advantages
    assert torch.allclose(prep.batch.advantages, want)
    assert trainer.update(groups)["train/tokens"] > 0
