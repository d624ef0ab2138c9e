"""Prompt selectors: DPS's hidden-Markov bookkeeping, Thompson counts, and their state."""

import random

import numpy as np
import pytest

from rollwise.stages.control.alloc_cures import CuresSelector
from rollwise.stages.control.select_dps import (
    PARTIAL,
    SOLVED,
    UNSOLVED,
    DPSSelector,
    PromptHMM,
    column_normalize,
    observed_state,
)
from rollwise.stages.control.select_insight import InsightSelector
from rollwise.stages.control.select_thompson import ThompsonSelector
from rollwise.stages.control.select_vade import VadeSelector
from rollwise.types import Problem


def pool(n):
    return [Problem(id=f"p{i}", prompt=str(i), answer="0") for i in range(n)]


def test_observed_state_mapping():
    assert observed_state(0, 8) == 0 and observed_state(8, 8) == 2
    assert observed_state(1, 8) == observed_state(7, 8) == PARTIAL


@pytest.mark.parametrize("decay, prior", [(1.0, "flat"), (0.7, "flat"), (0.7, "stability"),
                                          (0.7, "progress"), (0.7, "local")])
def test_matrices_stay_column_stochastic_and_beliefs_sum_to_one(decay, prior):
    rng = random.Random(0)
    dps = DPSSelector(decay=decay, prior_name=prior)
    for step in range(1, 40):
        chosen = dps.select(pool(30), 8, rng)
        dps.observe({p.id: (rng.randint(0, 8), 8) for p in chosen}, step)
        for pid in list(dps.prompts):
            h = dps.hmm(pid)
            assert np.allclose(column_normalize(h.alpha).sum(0), 1)
            assert np.isclose(h.belief.sum(), 1) and (h.belief >= 0).all()


def test_repeated_partial_observations_raise_p_partial():
    dps = DPSSelector()
    before = dps.hmm("x").belief[PARTIAL]
    history = []
    for step in range(1, 8):
        dps.observe({"x": (3, 8)}, step)
        history.append(dps.hmm("x").belief[PARTIAL])
    assert history[0] > before and all(b > a for a, b in zip(history, history[1:]))


def test_unobserved_belief_drifts_to_the_stationary_distribution():
    dps = DPSSelector()
    for step, obs in enumerate([(0, 8), (4, 8), (8, 8), (8, 8), (2, 8)], start=1):
        dps.observe({"x": obs}, step)
    h = dps.prompts["x"]
    P = column_normalize(h.alpha)
    vals, vecs = np.linalg.eig(P)
    stationary = np.real(vecs[:, np.argmin(abs(vals - 1))])
    stationary /= stationary.sum()
    dists = []
    for k in range(1, 30):
        dps.observe({}, 5 + k)  # a step in which x is not selected
        dists.append(np.abs(dps.hmm("x").belief - stationary).sum())
    assert dists[-1] < 1e-6 and dists[-1] < dists[0]


def test_lazy_updates_equal_updating_every_prompt_every_step():
    rng = random.Random(1)
    dps = DPSSelector(decay=0.8)
    eager = {f"p{i}": PromptHMM(np.ones((3, 3)), np.full(3, 1 / 3), np.full(3, 1 / 3))
             for i in range(6)}
    for step in range(1, 25):
        seen = {f"p{i}": (rng.randint(0, 4), 4) for i in range(6) if rng.random() < 0.3}
        dps.observe(seen, step)
        for pid, h in eager.items():
            if pid in seen:
                h.observe(observed_state(*seen[pid]), np.ones((3, 3)), 0.8)
            else:
                h.unobserved(np.ones((3, 3)), 0.8)
    for pid, h in eager.items():
        lazy = dps.hmm(pid)
        assert np.allclose(lazy.alpha, h.alpha) and np.allclose(lazy.belief, h.belief)


def test_dps_picks_the_partially_solved_prompts_from_its_candidates():
    dps = DPSSelector(candidate_ratio=100)
    outcomes = {f"p{i}": ((4, 8) if i % 3 == 0 else (0, 8) if i % 3 == 1 else (8, 8))
                for i in range(30)}
    for step in range(1, 4):
        dps.observe(outcomes, step)
    chosen = dps.select(pool(30), 10, random.Random(0))
    assert sorted(int(p.id[1:]) for p in chosen) == list(range(0, 30, 3))


def test_thompson_prefers_prompts_near_the_target():
    ts = ThompsonSelector()
    ts.observe({f"p{i}": ((20, 40) if i < 5 else (0, 40) if i < 10 else (40, 40))
                for i in range(15)}, 1)
    chosen = ts.select(pool(15), 5, random.Random(0))
    assert sorted(p.id for p in chosen) == [f"p{i}" for i in range(5)]
    assert ts.counts["p0"] == [21, 21]


@pytest.mark.parametrize("make", [lambda: DPSSelector(decay=0.9), ThompsonSelector,
                                  VadeSelector, lambda: InsightSelector(k=4, decay=0.9),
                                  CuresSelector])
def test_state_round_trips_and_continues_identically(make):
    rng = random.Random(3)
    a = make()
    for step in range(1, 6):
        a.observe({p.id: (rng.randint(0, 8), 8) for p in a.select(pool(20), 5, rng)}, step)
    b = make()
    b.load_state_dict(a.state_dict())
    ra, rb = random.Random(9), random.Random(9)
    assert [p.id for p in a.select(pool(20), 5, ra)] == [p.id for p in b.select(pool(20), 5, rb)]


def test_a_jump_the_local_prior_rules_out_is_counted_not_nan():
    """'local' gives unsolved -> solved prior weight 0; seeing it must add one count there."""
    dps = DPSSelector(prior_name="local")
    dps.observe({"x": (0, 8)}, 1)
    dps.observe({"x": (8, 8)}, 2)
    h = dps.hmm("x")
    assert np.isfinite(h.alpha).all() and np.isclose(h.belief.sum(), 1)
    assert h.alpha[SOLVED, UNSOLVED] == pytest.approx(1.0)


def test_one_observation_ranks_mixed_over_unseen_over_solved():
    # hand-computed: U adds the transition's soft count to row o; the prediction is column o
    # of P. flat: (1, 4/3, 1) / (10/3); stability: (0.5, 1.5, 0.5) / 2.5
    def after_one(prior):
        dps = DPSSelector(prior_name=prior)
        dps.observe({"mixed": (4, 8), "solved": (8, 8), "unsolved": (0, 8)}, 1)
        return [dps.score(p) for p in ("mixed", "unseen", "solved", "unsolved")]
    assert after_one("flat") == pytest.approx([0.4, 1 / 3, 0.3, 0.3])
    assert after_one("stability") == pytest.approx([0.6, 1 / 3, 0.2, 0.2])


def test_unknown_prior_is_refused_by_name():
    with pytest.raises(ValueError, match="dps.prior"):
        DPSSelector(prior_name="steady").hmm("x")


def test_prompt_outcomes_count_full_rewards_per_prompt():
    """What selectors learn from, and what `rollwise bench select` tallies from a step's
    result: successes are rewards of at least 1, against a count by hand."""
    from rollwise.stages.control.stage import prompt_outcomes
    from rollwise.types import Group, Sample

    def group(pid, rewards):
        return Group(pid, [Sample(prompt_id=pid, prompt_ids=[1], reward=r) for r in rewards])
    got = prompt_outcomes([group("a", [1.0, 0.0, 0.5, 1.2]), group("b", [0.0, 0.0]),
                           group("c", [1.0])])
    assert got == {"a": (2, 4), "b": (0, 2), "c": (1, 1)}
