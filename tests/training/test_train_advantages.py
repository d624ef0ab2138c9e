"""Advantage estimators against naive per-group loops and hand-computed values."""

import math
import statistics

import pytest
import torch

from rollwise import registry
from rollwise.training.advantages import (
    AdvantageInputs,
    compute_advantages,
    get_advantage,
    get_token_shaping,
)

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0,  # group 0: five samples
           0.5, 0.2, 0.9,  # group 1
           0.0, 0.0, 0.0, 0.0]  # group 2: all equal
GROUPS = [0] * 5 + [1] * 3 + [2] * 4


def _inputs(rewards=REWARDS, groups=GROUPS, **kw):
    return AdvantageInputs(torch.tensor(rewards), torch.tensor(groups), **kw)


def _by_group(rewards, groups):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def _naive_whiten(xs, eps):
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    return [(x - mean) / (std + eps) for x in xs]


def naive(name, rewards, groups):
    """Per-sample loops in plain Python, written from the papers' formulas."""
    adv = [0.0] * len(rewards)
    for idx in _by_group(rewards, groups).values():
        r = [rewards[i] for i in idx]
        mean = statistics.fmean(r)
        std = statistics.stdev(r) if len(r) > 1 else 0.0
        for i in idx:
            if name == "grpo":
                adv[i] = (rewards[i] - mean) / (std + 1e-6)
            elif name in ("dr_grpo", "reinforce_pp_baseline"):
                adv[i] = rewards[i] - mean
            elif name == "rloo":
                others = [rewards[j] for j in idx if j != i]
                adv[i] = rewards[i] - sum(others) / len(others)
            elif name == "reinforce_pp":
                adv[i] = rewards[i]
    if name.startswith("reinforce_pp"):
        adv = _naive_whiten(adv, 1e-6)
    return adv


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp",
                                  "reinforce_pp_baseline"])
def test_estimator_matches_naive_loop(name):
    out = get_advantage(name)(_inputs())
    assert out.advantages.tolist() == pytest.approx(naive(name, REWARDS, GROUPS), abs=1e-5)
    assert out.keep.all()


def test_grpo_hand_values_and_equal_group_is_zero():
    adv = get_advantage("grpo")(_inputs()).advantages
    # group 0: mean 0.6, unbiased std sqrt(0.3)
    assert adv[0].item() == pytest.approx(0.4 / math.sqrt(0.3), rel=1e-5)
    assert adv[1].item() == pytest.approx(-0.6 / math.sqrt(0.3), rel=1e-5)
    assert adv[8:].abs().max() == 0


def test_rloo_equals_scaled_mean_baseline():
    # G/(G-1) (r - mean): the leave-one-out identity, for group 1 (G=3)
    adv = get_advantage("rloo")(_inputs()).advantages
    mean = (0.5 + 0.2 + 0.9) / 3
    assert adv[5].item() == pytest.approx(1.5 * (0.5 - mean), abs=1e-6)


def naive_mc_grpo(rewards, groups, eps=1e-3):
    adv, keep = [0.0] * len(rewards), [True] * len(rewards)
    for idx in _by_group(rewards, groups).values():
        ranked = sorted(idx, key=lambda i: (rewards[i], idx.index(i)))
        pivot = ranked[(len(idx) - 1) // 2]
        med = rewards[pivot]
        mad = statistics.median_low([abs(rewards[i] - med) for i in idx])
        for i in idx:
            adv[i] = (rewards[i] - med) / (mad + eps)
        keep[pivot] = len(idx) == 1
    return adv, keep


def test_mc_grpo_matches_naive_median_and_drops_one_pivot_per_group():
    rewards = [0.3, 0.9, 0.1, 0.5, 0.7,  0.2, 0.8, 0.4]
    groups = [0] * 5 + [1] * 3
    out = get_advantage("mc_grpo")(_inputs(rewards, groups))
    adv, keep = naive_mc_grpo(rewards, groups)
    assert out.advantages.tolist() == pytest.approx(adv, rel=1e-5)
    assert out.keep.tolist() == keep
    assert out.keep.tolist().count(False) == 2
    # group 0: median 0.5 (index 3), MAD = median(|.2,.4,.4,0,.2|) = 0.2
    assert not out.keep[3] and out.advantages[1].item() == pytest.approx(0.4 / 0.201, rel=1e-5)


def test_mc_grpo_binary_rewards_with_zero_mad_stays_finite():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # MAD 0 in both groups
    groups = [0] * 5 + [1] * 5
    out = compute_advantages("mc_grpo", _inputs(rewards, groups))
    assert torch.isfinite(out.advantages).all()
    assert out.metrics["mad_zero_groups"] == 2
    assert out.advantages[0].item() == pytest.approx(1000.0)  # 1 / eps, flagged in the docs
    assert out.advantages[5:].abs().max() == 0  # an all-equal group: zero advantage
    capped = compute_advantages("mc_grpo", _inputs(rewards, groups), clip=5.0)
    assert capped.advantages.abs().max() == 5.0 and capped.metrics["clipped"] == 1


def test_gdpo_matches_naive_and_separates_equal_sums():
    # two channels whose sums are all 1: GRPO on the sum sees no signal, GDPO does
    a = [1.0, 0.0, 1.0, 0.0]
    b = [0.0, 1.0, 0.0, 1.0]
    groups = [0, 0, 0, 0]
    sums = [x + y for x, y in zip(a, b)]
    x = _inputs(sums, groups, channels={"a": torch.tensor(a), "b": torch.tensor(b)},
                channel_weights={"a": 2.0})
    grpo = get_advantage("grpo")(_inputs(sums, groups)).advantages
    gdpo = get_advantage("gdpo")(x).advantages
    assert len(set(grpo.tolist())) == 1 and len({round(v, 5) for v in gdpo.tolist()}) == 2
    # naive: per-channel group normalisation, weighted sum, batch whitening
    na = _naive_whiten(a, 1e-4)  # one group = the batch here
    nb = _naive_whiten(b, 1e-4)
    total = [2.0 * p + q for p, q in zip(na, nb)]
    assert gdpo.tolist() == pytest.approx(_naive_whiten(total, 1e-4), abs=1e-5)


def test_gdpo_needs_channels_and_rejects_unknown_weight_names():
    with pytest.raises(ValueError, match="reward channels"):
        get_advantage("gdpo")(_inputs())
    x = _inputs([1.0, 0.0], [0, 0], channels={"a": torch.tensor([1.0, 0.0])},
                channel_weights={"zz": 1.0})
    with pytest.raises(ValueError, match="zz"):
        get_advantage("gdpo")(x)


def test_registry_errors_name_the_field_and_choices():
    with pytest.raises(ValueError, match="train.advantage.*grpo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_token_shaping("no_such_module_xyz:fn")
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "mc_grpo", "gdpo"} <= \
        set(registry.names("advantage"))


def test_token_shaping_hook_resolves_dotted_paths():
    fn = get_token_shaping("torch:neg")  # any importable callable with the signature works
    assert fn(torch.ones(2, 3)).sum() == -6
    assert torch.equal(get_token_shaping("none")(torch.ones(2, 3), None), torch.ones(2, 3))


# ---- XRPO's novelty-aware sharpening -----------------------------------------------------

LOGPROB_MEANS = [-0.2, -1.5, -0.3, -0.9, -0.1,  # group 0: correct at 0, 3, 4
                 -0.4, -2.0, -1.0,
                 -0.5, -3.0, -0.1, -0.2]


def test_xrpo_sharpening_against_a_naive_loop_bounded_and_zero_for_wrong_answers():
    lam, kappa = 1.5, 0.4
    out = get_advantage("xrpo")(_inputs(logprob_means=torch.tensor(LOGPROB_MEANS),
                                        sharpen=(lam, kappa))).advantages.tolist()
    base = get_advantage("grpo")(_inputs()).advantages.tolist()
    for members in _by_group(REWARDS, GROUPS).values():
        s_mean = statistics.fmean(LOGPROB_MEANS[i] for i in members)
        for i in members:
            a = base[i]
            bonus = min(max(lam * (1 - math.exp(LOGPROB_MEANS[i] - s_mean)), 0), kappa * a) \
                if a > 0 else 0.0
            assert out[i] == pytest.approx(a + bonus, abs=1e-6)
            assert a <= out[i] + 1e-7 <= (1 + kappa) * max(a, 0) + 1e-6 if a > 0 else out[i] == a
    # the rare correct answer (-0.9 in group 0) gains; the likely one (-0.1) does not
    assert out[3] > base[3] and out[4] == pytest.approx(base[4])
    assert out[8:] == [0.0] * 4  # a group with equal rewards stays at zero


def test_xrpo_needs_log_probabilities():
    with pytest.raises(ValueError, match="log-probabilities"):
        get_advantage("xrpo")(_inputs())


GROUP_CENTRED = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "xrpo",
                 "nudge", "gdpo", "mc_grpo", "cod", "trace", "trace_tree"]


@pytest.mark.parametrize("name", GROUP_CENTRED)
@pytest.mark.parametrize("value", [0.3, 0.1, 1 / 3, 0.7, 1e6 + 0.1])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_the_value(name, value):
    """Six answers at 0.3: the float32 mean misses 0.3 by an ulp and the std (3e-8) is far
    below eps, so r - mean divided by it was +0.029 under GRPO (+0.043 with XRPO's bonus).
    Two groups, each flat at its own value, must both get exactly 0."""
    rewards = [value] * 6 + [value / 7] * 5
    groups = [0] * 6 + [1] * 5
    meta = [{"cod_key": (g,), "cod_return": r, "trace_anchor": g}
            for r, g in zip(rewards, groups)]
    x = _inputs(rewards, groups, channels={"a": torch.tensor(rewards)}, meta=meta,
                logprob_means=torch.linspace(-2.0, -1.0, len(rewards)))
    adv = get_advantage(name)(x).advantages
    assert torch.equal(adv, torch.zeros_like(adv)), (name, value, adv.tolist())


def test_a_batch_of_equal_rewards_whitened_over_the_batch_gets_exactly_zero():
    adv = get_advantage("reinforce_pp")(_inputs([0.3] * 6, [0, 0, 0, 1, 1, 1])).advantages
    assert torch.equal(adv, torch.zeros(6))
