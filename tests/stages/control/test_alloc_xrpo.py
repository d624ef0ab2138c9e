"""XRPO's rollout allocator: the t quantile against the table, the greedy allocation against a
naive loop that recomputes every priority, and where the extra rollouts go."""

from __future__ import annotations

import math

import pytest

from rollwise.config import load_config
from rollwise.stages.control.alloc_xrpo import XRPO, allocate, half_width, priority, t_quantile
from rollwise.types import Group, Problem, Sample


@pytest.mark.parametrize("df, want", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646),
                                      (15, 2.1314), (30, 2.0423)])
def test_t_quantile_matches_the_table(df, want):
    assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.95, 1) == pytest.approx(6.3138, abs=1e-4)


def test_priority_is_interval_shrinkage_plus_the_bonus():
    n, s, t = 5, 0.5, 40
    shrink = (t_quantile(0.975, 4) * s / math.sqrt(5) - t_quantile(0.975, 5) * s / math.sqrt(6))
    assert priority(n, s, t, 0.05, 0.3) == pytest.approx(
        shrink + 0.3 * math.sqrt(math.log(41) / 5))
    assert half_width(1, 0.5, 0.05) == math.inf


def _naive(stats, budget, n_max, alpha, lam):
    extra, handed = [0] * len(stats), sum(n for n, _ in stats)
    for _ in range(budget):
        open_ = [i for i, (n, _) in enumerate(stats) if n + extra[i] < n_max]
        if not open_:
            break
        best = max(open_, key=lambda i: (priority(stats[i][0] + extra[i], stats[i][1],
                                                  handed, alpha, lam), -i))
        extra[best] += 1
        handed += 1
    return extra


@pytest.mark.parametrize("stats, budget, n_max", [
    ([(4, 0.5), (4, 0.0), (4, 0.58), (4, 0.5)], 16, 16),
    ([(4, 0.0)] * 5, 20, 6),  # every prompt capped: the budget is not all spent
    ([(2, 0.7), (6, 0.4), (3, 0.0), (4, 0.52)], 11, 9),
])
def test_allocation_equals_recomputing_every_priority_each_time(stats, budget, n_max):
    for lam in (0.0, 0.1, 1.0):
        assert allocate(stats, budget, n_max, 0.05, lam) == _naive(stats, budget, n_max, 0.05,
                                                                   lam)
    got = allocate(stats, budget, n_max, 0.05, 0.1)
    assert sum(got) == min(budget, sum(n_max - n for n, _ in stats))
    assert all(n + e <= n_max for (n, _), e in zip(stats, got))


def test_extra_rollouts_go_to_uncertain_prompts_and_the_bonus_reaches_settled_ones():
    stats = [(4, 0.5), (4, 0.0), (4, 0.0), (4, 0.5)]
    assert allocate(stats, 8, 16, 0.05, 0.0) == [4, 0, 0, 4]  # no bonus: variance only
    assert allocate(stats, 16, 16, 0.05, 0.1) == [6, 2, 2, 6]  # the bonus reaches the rest


def test_the_sizer_spends_the_steps_budget_and_says_what_it_did():
    cfg = load_config(None, ["control.group_size=xrpo", "generate.group_size=8",
                             "control.xrpo.base=4"])
    sizer = XRPO(cfg)
    problems = [Problem(id=f"p{i}", prompt="x", answer="1") for i in range(3)]
    assert sizer.sizes(problems, 1) == [4, 4, 4]
    groups = []
    for i, rewards in enumerate([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]):
        samples = [Sample(uid=f"{i}-{j}", prompt_id=f"p{i}", prompt_ids=[1], response_ids=[2])
                   for j in range(4)]
        for s, r in zip(samples, rewards):
            s.reward = float(r)
        groups.append(Group(prompt_id=f"p{i}", samples=samples))
    extra = sizer.extra(groups)
    assert sum(extra) == 12 and extra[0] == max(extra)
    assert sizer.metrics()["control/xrpo/group_max"] == 4 + max(extra)


def test_a_base_above_the_group_size_is_refused_by_name():
    from rollwise.errors import ConfigError
    cfg = load_config(None, ["control.group_size=xrpo", "generate.group_size=4",
                             "control.xrpo.base=6"])
    with pytest.raises(ConfigError, match="base <= generate.group_size"):
        XRPO(cfg)
