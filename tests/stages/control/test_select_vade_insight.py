"""VADE and InSight, the Beta-posterior selectors: their scores against references computed
another way, their draws reproducible, their estimates following a drifting success rate, and
their settings taken by name (their state's round trip is in test_control_select.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from rollwise.config import load_config
from rollwise.registry import resolve
from rollwise.stages.control.select_insight import InsightSelector, mutual_information, score
from rollwise.stages.control.select_thompson import ThompsonSelector
from rollwise.stages.control.select_vade import VadeSelector
from rollwise.types import Problem


def pool(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", prompt=str(i), answer="0") for i in range(n)]


# ---- InSight's mutual information ---------------------------------------------------------

def _mi_by_quadrature(a: float, b: float, k: int, points: int = 200_001) -> float:
    """I(Y; theta) = H(Y) - E[H(Y | theta)] by integrating over theta on a fine grid."""
    theta = np.linspace(0, 1, points)[1:-1]
    density = np.exp((a - 1) * np.log(theta) + (b - 1) * np.log1p(-theta)
                     - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)))
    dx = theta[1] - theta[0]
    ys = np.arange(k + 1)
    choose = np.array([math.comb(k, int(y)) for y in ys], dtype=float)
    p_given = choose[:, None] * theta[None] ** ys[:, None] * (1 - theta[None]) ** (k - ys)[:, None]
    p_y = (p_given * density).sum(1) * dx
    h_y = -(p_y * np.log(p_y)).sum()
    h_given = -(np.where(p_given > 0, p_given * np.log(p_given), 0.0)).sum(0)
    return float(h_y - (h_given * density).sum() * dx)


@pytest.mark.parametrize("a, b, k", [(1, 1, 1), (1, 1, 8), (3, 5, 4), (12, 2, 8), (2.5, 7.5, 16)])
def test_mutual_information_matches_numerical_integration(a, b, k):
    assert mutual_information(a, b, k) == pytest.approx(_mi_by_quadrature(a, b, k), abs=2e-5)


def test_one_rollout_information_is_the_bernoulli_entropy_gap():
    """k = 1: I = H(mean) - E[H(theta)], with E[theta log theta] in digamma form."""
    a, b = 3.0, 2.0
    p = a / (a + b)
    h_mean = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    digamma = lambda x: mutual_information.__globals__["_digamma"](x)  # noqa: E731
    e_h = -(p * (digamma(a + 1) - digamma(a + b + 1))
            + (1 - p) * (digamma(b + 1) - digamma(a + b + 1)))
    assert mutual_information(a, b, 1) == pytest.approx(h_mean - e_h, rel=1e-9)


def test_at_equal_mean_less_evidence_scores_higher_and_mid_beats_extreme():
    assert score(2, 2, 8) > score(20, 20, 8) > score(200, 200, 8)
    assert score(5, 5, 8) > score(9, 1, 8)  # same evidence, the difficulty term decides
    assert score(1, 1, 8) > score(1, 1, 1)  # more rollouts, more to learn


def test_insight_picks_uncertain_mid_prompts_and_learns_from_outcomes():
    sel = InsightSelector(k=8)
    sel.observe({"p0": (4, 8), "p1": (40, 80), "p2": (8, 8), "p3": (0, 8)}, 1)
    chosen = [p.id for p in sel.select(pool(4), 3, random.Random(0))]
    # the mid prompt first; then the two barely observed extremes (tied, in the draw's order)
    # before the mid prompt whose rate 80 trials already pin down: difficulty alone,
    # p (1 - p), would rank p1 first of these
    assert chosen[0] == "p0" and set(chosen[1:]) == {"p2", "p3"}
    assert sel.counts["p0"] == [5, 5] and sel.metrics()["control/insight/score"] > 0


# ---- VADE -------------------------------------------------------------------------------

def test_vade_draws_are_reproducible_under_a_seed_and_rank_by_sampled_variance():
    sel = VadeSelector()
    sel.observe({f"p{i}": (i, 10) for i in range(11)}, 1)
    first = [p.id for p in sel.select(pool(11), 4, random.Random(5))]
    assert first == [p.id for p in sel.select(pool(11), 4, random.Random(5))]
    # the same draws, ranked by hand
    rng = random.Random(5)
    thetas = [rng.betavariate(*sel.posterior(f"p{i}")) for i in range(11)]
    want = sorted(range(11), key=lambda i: -thetas[i] * (1 - thetas[i]))[:4]
    assert first == [f"p{i}" for i in want]


def test_vade_two_scale_decay_equals_a_naive_weighted_sum():
    """The posterior after outcomes at several steps, from the history directly: fast evidence
    sum fast^(t - s) o_s on top of the slow rate sum slow^(t - s) o_s / its mass, held as at
    most prior_strength pseudo-counts, on top of the base prior."""
    sel = VadeSelector(fast_decay=0.7, slow_decay=0.95, prior_strength=3.0, prior=(1.0, 2.0))
    history = {2: (3, 8), 3: (5, 8), 7: (1, 8), 8: (8, 8)}
    for step, o in history.items():
        sel.observe({"p": o}, step)
    sel.observe({}, 10)  # two steps later, nothing observed

    def total(decay, i, t=10):
        return sum(decay ** (t - s) * (o[0] if i == 0 else o[1] - o[0])
                   for s, o in history.items())
    rate = total(0.95, 0) / (total(0.95, 0) + total(0.95, 1))
    want = (1.0 + 3.0 * rate + total(0.7, 0), 2.0 + 3.0 * (1 - rate) + total(0.7, 1))
    assert sel.posterior("p") == pytest.approx(want, rel=1e-12)
    assert VadeSelector().posterior("unseen") == (1.0, 1.0)


def test_vade_tracks_a_drifting_success_rate_where_undecayed_counts_lag():
    """p goes 0.1 -> 0.9 over 60 steps, 8 trials a step: the two-scale posterior's mean stays
    close; Beta counts without decay (thompson's default) average the whole past."""
    rng = np.random.default_rng(0)
    vade, plain = VadeSelector(), ThompsonSelector(decay=1.0)
    errors_vade, errors_plain = [], []
    for step in range(1, 61):
        p = 0.1 + 0.8 * step / 60
        o = {"p": (int(rng.binomial(8, p)), 8)}
        vade.observe(o, step)
        plain.observe(o, step)
        if step > 20:
            (a, b), (c, d) = vade.posterior("p"), plain.posterior("p")
            errors_vade.append(abs(a / (a + b) - p))
            errors_plain.append(abs(c / (c + d) - p))
    assert np.mean(errors_vade) < 0.1 < np.mean(errors_plain)


def test_a_prompt_not_drawn_falls_back_to_its_long_run_rate_by_steps_elapsed():
    sel = VadeSelector(fast_decay=0.5, slow_decay=0.99, prior_strength=4.0)
    for step in range(1, 11):
        sel.observe({"p": (6, 8)}, step)  # a long-run rate of 0.75
    early = sel.posterior("p")
    sel.observe({"q": (0, 8)}, 40)  # only another prompt observed since
    a, b = sel.posterior("p")
    assert a + b < sum(early)  # its recent evidence has faded: the draws explore it again
    faded = 2 * 0.5 ** 30  # what is left of the recent groups (their sum decayed)
    assert (a, b) == pytest.approx((1 + 4 * 0.75 + 6 * faded, 1 + 4 * 0.25 + 2 * faded))


def test_both_are_chosen_by_name_with_their_settings():
    cfg = load_config(None, ["control.selector=vade", "control.vade.fast_decay=0.6",
                             "generate.group_size=6"])
    vade = resolve("selector", "vade", "control.selector")(cfg)
    assert isinstance(vade, VadeSelector) and vade.decays == (0.6, 0.98)
    insight = resolve("selector", "insight", "control.selector")(cfg)
    assert isinstance(insight, InsightSelector) and insight.k == 6  # k defaults to the group
