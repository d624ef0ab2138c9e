"""CurES: the gradient-variance term against an exact enumeration of the estimator's variance,
the embedding gradient norms against a full backward pass per sequence, the softmax selection
against its probabilities, and budget splitting against its targets."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rollwise.config import load_config
from rollwise.errors import ConfigError
from rollwise.stages.control.alloc_cures import (
    Cures,
    CuresSelector,
    cures_sigma,
    embedding_grad_norms,
    posterior_rate,
)
from rollwise.stages.control.group_size import proportional_sizes
from rollwise.types import Group, Problem, Sample


@pytest.mark.parametrize("p, gc, gw", [(0.3, [1.0, 2.0], [0.5]), (0.5, [1.0], [1.0]),
                                       (0.9, [3.0, 0.2, 1.1], [2.0, 2.5])])
def test_sigma_is_the_std_of_the_norm_weighted_advantage(p, gc, gw):
    # X = g (r - p): r ~ Bernoulli(p), g uniform over the class's norms; Var by enumeration
    outcomes = [(p / len(gc), g * (1 - p)) for g in gc] + \
               [((1 - p) / len(gw), g * (0 - p)) for g in gw]
    mean = sum(w * x for w, x in outcomes)
    var = sum(w * x * x for w, x in outcomes) - mean ** 2
    assert cures_sigma(p, gc, gw) == pytest.approx(math.sqrt(var), rel=1e-12)
    assert cures_sigma(p, [2.0], [2.0]) == pytest.approx(2 * math.sqrt(p * (1 - p)))


def _untied_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=False,
                      max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg).float()


def test_embedding_norms_equal_a_full_backward_per_sequence():
    model = _untied_model()
    seqs = [([1, 5, 7], [9, 9, 3]), ([2], [4, 8, 12, 5, 6]), ([3, 3, 3, 3], [1])]
    want = []
    for p, r in seqs:  # naive: the embedding matrix's own gradient, one sequence at a time
        model.zero_grad()
        ids = torch.tensor([p + r])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), ids[0, len(p):]].sum().backward()
        want.append(float(model.get_input_embeddings().weight.grad.norm()))
    model.zero_grad(set_to_none=True)
    assert embedding_grad_norms(model, seqs, batch=2) == pytest.approx(want, rel=1e-5)
    assert embedding_grad_norms(model, seqs, batch=8) == pytest.approx(want, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient is left


@pytest.mark.parametrize("weights, budget, lo, hi", [
    ([1.0, 2.0, 3.0, 4.0], 32, 2, 16), ([0.0, 0.0, 1.0], 12, 2, 6), ([0.0] * 5, 20, 1, 8),
    ([5.0, 0.1, 0.1], 30, 2, 12), ([0.3, 0.31, 0.29], 10, 1, 10)])
def test_proportional_sizes_keep_bounds_and_budget_and_track_the_targets(weights, budget, lo,
                                                                        hi):
    sizes = proportional_sizes(weights, budget, lo, hi)
    assert sum(sizes) == min(budget, hi * len(weights))
    assert all(lo <= s <= hi for s in sizes)
    uncapped = [i for i, s in enumerate(sizes) if s < hi]
    left = sum(sizes[i] - lo for i in uncapped)
    total = sum(weights[i] for i in uncapped)
    for i in uncapped:  # within one of the exact share among the prompts below the cap
        target = lo + left * (weights[i] / total if total else 1 / len(uncapped))
        assert abs(sizes[i] - target) < 1


def test_proportional_sizes_is_the_best_rounding_on_small_cases():
    # brute force: every integer vector in bounds with the budget; the chosen one is closest
    weights, budget, lo, hi = [0.2, 0.5, 0.3], 11, 1, 6
    got = proportional_sizes(weights, budget, lo, hi)
    targets = [lo + (budget - 3 * lo) * w for w in weights]
    best = min((v for v in itertools.product(range(lo, hi + 1), repeat=3) if sum(v) == budget),
               key=lambda v: sum((a - t) ** 2 for a, t in zip(v, targets)))
    assert got == list(best)


def test_selection_frequencies_follow_the_softmax_of_sqrt_pq():
    sel = CuresSelector(temperature=0.2)
    pool = [Problem(id=f"p{i}", prompt="x", answer="1") for i in range(4)]
    sel.observe({"p0": (8, 8), "p1": (4, 8), "p2": (1, 8)}, 1)  # p3 unseen: p = 1/2
    rates = [posterior_rate(8, 8), posterior_rate(4, 8), posterior_rate(1, 8), 0.5]
    w = [math.exp(math.sqrt(r * (1 - r)) / 0.2) for r in rates]
    rng = random.Random(0)
    counts = Counter(sel.select(pool, 1, rng)[0].id for _ in range(20000))
    for i, wi in enumerate(w):
        assert counts[f"p{i}"] / 20000 == pytest.approx(wi / sum(w), abs=0.015)
    a = [p.id for p in sel.select(pool, 3, random.Random(7))]
    assert a == [p.id for p in sel.select(pool, 3, random.Random(7))]  # reproducible
    assert len(set(a)) == 3  # without replacement
    restored = CuresSelector(0.2)
    restored.load_state_dict(sel.state_dict())
    assert restored.weights(pool) == sel.weights(pool)


def _groups(results: dict[str, list[int]]) -> list[Group]:
    out = []
    for pid, rewards in results.items():
        samples = [Sample(prompt_id=pid, prompt_ids=[1, 2], response_ids=[3, 4 + j])
                   for j in range(len(rewards))]
        for s, r in zip(samples, rewards):
            s.reward = float(r)
        out.append(Group(pid, samples, Problem(id=pid, prompt="x", answer="1")))
    return out


def test_sizer_without_gradients_spends_the_budget_by_sqrt_pq():
    cfg = load_config(None, ["control.group_size=cures", "generate.group_size=8",
                             "control.cures.gradient=none"])
    sizer = Cures(cfg)
    sizer.observe(_groups({"easy": [1] * 8, "mid": [1, 0] * 4, "hard": [0] * 8}), 1)
    problems = [Problem(id=k, prompt="x", answer="1") for k in ("easy", "mid", "hard", "new")]
    rates = [posterior_rate(8, 8), posterior_rate(4, 8), posterior_rate(0, 8), 0.5]
    assert sizer.sizes(problems, 2) == proportional_sizes(
        [math.sqrt(r * (1 - r)) for r in rates], 32, 2, 16)
    sizes = dict(zip(["easy", "mid", "hard", "new"], sizer.sizes(problems, 2)))
    assert sizes["mid"] > sizes["easy"] and sum(sizes.values()) == 32


def test_sizer_measures_gradients_with_the_bound_policy_and_uses_them():
    cfg = load_config(None, ["control.group_size=cures", "generate.group_size=4",
                             "control.cures.grad_samples=4"])
    sizer = Cures(cfg)
    with pytest.raises(ConfigError, match="control.cures.gradient = none"):
        sizer.bind(policy=None)
    model = _untied_model()
    sizer.bind(policy=model)
    groups = _groups({"a": [1, 0, 0, 1], "b": [0, 0, 0, 0]})
    sizer.observe(groups, 1)
    s = groups[0].samples
    want = embedding_grad_norms(model, [(x.prompt_ids, x.response_ids) for x in s])
    assert sizer.norms["a"] == [[want[0], want[3]], [want[1], want[2]]]
    p = posterior_rate(2, 4)
    problems = [Problem(id="a", prompt="x", answer="1"), Problem(id="b", prompt="x", answer="1")]
    sig = sizer.sigmas(problems)
    assert sig[0] == pytest.approx(cures_sigma(p, [want[0], want[3]], [want[1], want[2]]))
    restored = Cures(cfg)
    restored.load_state_dict(sizer.state_dict())
    assert restored.sigmas(problems) == sig
