"""MSSR's parts: the group-free baseline against a naive running mean over earlier steps only,
the single-rollout advantage, and the entropy-based shaping's bounds against closed forms."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rollwise.config import load_config
from rollwise.stages.control.baseline import Baseline
from rollwise.stages.control.value_v0 import Record, V0Predictor
from rollwise.training.advantages import (
    ENTROPY_ALPHA,
    ENTROPY_KAPPA,
    AdvantageInputs,
    entropy_shaping,
    mssr,
)
from rollwise.types import Group, Problem, Sample


def _group(pid: str, rewards: list[float], prompt: str = "x") -> Group:
    samples = [Sample(prompt_id=pid, prompt_ids=[1], response_ids=[2]) for _ in rewards]
    for s, r in zip(samples, rewards):
        s.reward = r
    return Group(pid, samples, Problem(id=pid, prompt=prompt, answer="1"))


def test_the_running_baseline_is_a_decayed_mean_of_earlier_steps_only():
    cfg = load_config(None, ["control.baseline=running", "control.baseline_decay=0.7",
                             "control.baseline_prior=2"])
    tracker, rng = Baseline(cfg), random.Random(0)
    history: list[tuple[str, int, float]] = []  # (prompt, step, reward)
    for step in range(1, 12):
        groups = [_group(p, [float(rng.random() < 0.3 + 0.1 * i)])
                  for i, p in enumerate(rng.sample(["a", "b", "c", "d"], 2))]
        tracker.annotate(groups, step)
        for g in groups:
            def decayed(rows):
                return sum(0.7 ** (step - t) * r for _, t, r in rows), \
                    sum(0.7 ** (step - t) for _, t, _ in rows)
            s_all, w_all = decayed(history)
            m = s_all / w_all if w_all else 0.5
            s, w = decayed([h for h in history if h[0] == g.prompt_id])
            assert g.samples[0].meta["baseline"] == pytest.approx((2 * m + s) / (2 + w))
        history += [(g.prompt_id, step, g.rewards[0]) for g in groups]
    restored = Baseline(cfg)
    restored.load_state_dict(tracker.state_dict())
    assert restored.value("a", 12) == tracker.value("a", 12)


def test_the_v0_baseline_is_the_prediction_made_before_the_step():
    cfg = load_config(None, ["control.baseline=v0"])
    tracker = Baseline(cfg)
    ref = V0Predictor(cfg.control.v0.history, cfg.control.v0.bandwidth, cfg.control.v0.decay,
                      cfg.control.v0.prior_strength)
    for step, (prompt, r) in enumerate([("What is 2+2?", 1.0), ("What is 3+3?", 0.0),
                                        ("What is 2+3?", 1.0)], 1):
        g = _group(f"p{step}", [r], prompt)
        want = ref.predict([prompt], step)[0]
        tracker.annotate([g], step)
        assert g.samples[0].meta["baseline"] == pytest.approx(want)
        ref.observe([Record(prompt, r, 1, step)])


def test_single_rollout_advantage_is_reward_less_baseline_and_needs_one():
    meta = [{"baseline": 0.25}, {"baseline": 0.8}]
    out = mssr(AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), meta=meta))
    assert out.advantages.tolist() == pytest.approx([0.75, -0.8])
    with pytest.raises(ValueError, match="control.baseline"):
        mssr(AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]), meta=[{}]))
    with pytest.raises(ValueError, match="control.baseline = running"):
        load_config(None, ["train.advantage=mssr"])


def test_entropy_shaping_is_bounded_keeps_signs_and_matches_its_closed_form():
    torch.manual_seed(0)
    adv = torch.tensor([[0.9] * 5, [-0.6] * 5, [0.0] * 5, [0.05] * 5])
    entropy = torch.rand(4, 5) * 4
    got = entropy_shaping(adv, SimpleNamespace(policy_entropy=entropy))
    want = adv + torch.minimum(ENTROPY_ALPHA * entropy, adv.abs() / ENTROPY_KAPPA)
    assert torch.allclose(got, want)
    assert (torch.sign(got) == torch.sign(adv)).all()  # never flips; zero stays zero
    assert (got.abs() <= adv.abs() * (1 + 1 / ENTROPY_KAPPA) + 1e-7).all()
    assert (got[1].abs() <= adv[1].abs()).all()  # a negative advantage only shrinks
