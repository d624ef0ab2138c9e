"""Test-time search: DORA's and solution-level allocation against closed forms on a hand-made
tree, budget rounding against the exact shares, and the whole search on a scripted engine where
the popular direction is wrong and the confident one right."""

from __future__ import annotations

import math

import pytest

from rollwise import models
from rollwise.config import SearchConfig
from rollwise.engine.base import Completion
from rollwise.evaluate import EVAL_SEED
from rollwise.search import allocation_weights, direction_ids, search_vote, split_budget
from rollwise.tasks.prompts import Prompter
from rollwise.types import Problem


def test_dora_gives_the_strong_direction_its_quality_not_the_weak_ones_count():
    # one confident candidate in direction 0; four less confident ones sharing direction 1
    quality, dirs, T = [-0.1, -0.3, -0.3, -0.3, -0.3], [0, 1, 1, 1, 1], 0.2
    a, b = math.exp(-0.1 / T), math.exp(-0.3 / T)
    solution = allocation_weights(quality, dirs, T, "solution")
    dora = allocation_weights(quality, dirs, T, "dora")
    assert solution[0] == pytest.approx(a / (a + 4 * b))
    assert dora[0] == pytest.approx(a / (a + b))  # each direction: the mean of its weights
    assert sum(dora[1:]) == pytest.approx(b / (a + b))
    assert dora[0] > 0.5 > solution[0]
    # with one candidate per direction the two rules agree
    assert allocation_weights([-0.1, -0.3], [0, 1], T, "dora") == \
        pytest.approx(allocation_weights([-0.1, -0.3], [0, 1], T, "solution"))
    with pytest.raises(ValueError, match="'dora' or 'solution'"):
        allocation_weights(quality, dirs, T, "beam")


@pytest.mark.parametrize("weights, budget", [([0.731, 0.067, 0.067, 0.067, 0.068], 8),
                                             ([0.5, 0.5], 7), ([0.2, 0.3, 0.5], 0)])
def test_budget_split_sums_and_stays_within_one_of_each_share(weights, budget):
    counts = split_budget(weights, budget)
    assert sum(counts) == budget
    assert all(abs(c - budget * w) < 1 for c, w in zip(counts, weights))


def test_directions_are_identical_openings_in_order_of_appearance():
    assert direction_ids([(1, 2), (3,), (1, 2), (3,), (4, 4)]) == [0, 1, 0, 1, 2]


class ScriptedEngine:
    """First candidates: the first drawn opens 'aa' and answers 7, confidently; the others open
    'bb' and answer 3. A continuation answers as its direction does."""

    def __init__(self, tok, prompt_len, budget):
        self.tok, self.prompt_len, self.budget = tok, prompt_len, budget
        self.continued: list[str] = []

    def ids(self, text):
        return self.tok(text)["input_ids"]

    def generate(self, requests):
        out = []
        for r in requests:
            head = self.tok.decode(r.prompt_ids[self.prompt_len:])
            if head:
                self.continued.append(head)
                text, lp = ("=7", -0.5) if head == "aa" else ("=3", -0.5)
            else:
                j = r.params.seed - EVAL_SEED  # problem 0: its draw index
                text, lp = ("aa=7", -0.1) if j == 0 else ("bb=3", -0.3)
            ids = self.ids(text)
            out.append(Completion(r.id, ids, [lp] * len(ids), [0.0] * len(ids),
                                  [0] * len(ids), "length"))
        return out


@pytest.mark.parametrize("allocation, solved, to_strong", [("dora", 1.0, 6), ("solution", 0.0, 4)])
def test_search_spends_the_budget_by_direction_and_votes(allocation, solved, to_strong):
    # 8 left: dora 8 x 0.731 = 5.85 -> 6 to the strong opening; solution 8 x 0.405 = 3.24
    # and 1.19 to each weak candidate -> 3 + 1 by the largest remainder = 4
    tok = models.char_tokenizer()
    prompter = Prompter.plain(tok)
    problem = Problem(id="p", prompt="q", answer="7")
    engine = ScriptedEngine(tok, len(prompter.ids(problem)), 13)
    cfg = SearchConfig(allocation=allocation, directions=5, prefix_tokens=2, temperature=0.2)
    out = search_vote(engine, prompter, [problem], lambda t, p: (float(t.endswith("=7")), ""),
                      lambda t: t.split("=")[-1], 16, 13, 1.0, cfg)
    assert len(engine.continued) == 8  # the budget left after the 5 candidates
    assert engine.continued.count("aa") == to_strong
    assert out["eval/search_acc"] == solved and out["eval/search_directions"] == 2


def test_search_refuses_settings_it_cannot_play():
    tok = models.char_tokenizer()
    prompter = Prompter.plain(tok)
    with pytest.raises(ValueError, match="prefix_tokens"):
        search_vote(None, prompter, [], None, None, 8, 13, 1.0,
                    SearchConfig(directions=4, prefix_tokens=8))
    with pytest.raises(ValueError, match="directions"):
        search_vote(None, prompter, [], None, None, 16, 4, 1.0, SearchConfig(directions=4))
