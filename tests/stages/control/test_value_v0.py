"""V0: the kernel estimate against a naive loop, convergence to the true success rate of
unseen prompts on a synthetic history, a drifting rate tracked, the calibration numbers against
hand computations, allocation by p (1 - p), and the router."""

from __future__ import annotations

import math
import random

import pytest

from rollwise.config import load_config
from rollwise.stages.control.group_size import proportional_sizes
from rollwise.stages.control.prompt_features import features
from rollwise.stages.control.value_v0 import V0, Record, V0Predictor, auc, brier, route
from rollwise.types import Group, Problem, Sample


def _prompt(kind: str, rng: random.Random) -> str:
    a, b = rng.randrange(10, 99), rng.randrange(10, 99)
    return f"What is {a} plus {b}?" if kind == "add" else f"Multiply {a} by {b} exactly."


def _history(rng, rates: dict[str, float], groups: int, step: int, n: int = 8) -> list[Record]:
    out = []
    for _ in range(groups):
        kind = rng.choice(sorted(rates))
        out.append(Record(_prompt(kind, rng), sum(rng.random() < rates[kind] for _ in range(n)),
                          n, step))
    return out


def test_prediction_equals_the_formula_computed_naively():
    v0 = V0Predictor(history=50, bandwidth=0.2, decay=0.8, prior_strength=3.0, dim=256)
    recs = [Record("What is 12 plus 30?", 6, 8, 1), Record("Multiply 4 by 9 exactly.", 1, 8, 2),
            Record("What is 40 plus 41?", 8, 8, 3)]
    v0.observe(recs)
    text, step = "What is 11 plus 31?", 3
    fx = features([text], 256)[0]
    fr = features([r.text for r in recs], 256)
    rec = [0.8 ** (step - r.step) for r in recs]
    m = sum(w * r.successes for w, r in zip(rec, recs)) / \
        sum(w * r.trials for w, r in zip(rec, recs))
    w = [math.exp((float(fx @ fr[j]) - 1) / 0.2) * rec[j] for j in range(3)]
    want = (3.0 * m + sum(wj * r.successes for wj, r in zip(w, recs))) / \
        (3.0 + sum(wj * r.trials for wj, r in zip(w, recs)))
    assert v0.predict([text], step)[0] == pytest.approx(want, rel=1e-6)  # float32 features
    assert v0.base_rate(step) == pytest.approx(m)
    assert V0Predictor().predict(["anything"], 0) == [0.5]  # no history: the flat prior


def test_unseen_prompts_are_predicted_at_their_familys_true_rate():
    rng = random.Random(0)
    v0 = V0Predictor(history=400)
    v0.observe(_history(rng, {"add": 0.8, "mul": 0.15}, 300, step=0))
    for kind, rate in (("add", 0.8), ("mul", 0.15)):
        preds = v0.predict([_prompt(kind, rng) for _ in range(40)], 0)
        assert sum(preds) / len(preds) == pytest.approx(rate, abs=0.06)


def test_a_drifting_rate_is_tracked_by_the_recency_decay():
    rng = random.Random(1)
    v0 = V0Predictor(history=1000, decay=0.7)
    errors = []
    for step in range(30):
        true = 0.1 + 0.8 * step / 29  # the policy improves
        pred = sum(v0.predict([_prompt("add", rng) for _ in range(20)], step)) / 20
        errors.append(abs(pred - true))
        v0.observe(_history(rng, {"add": true}, 16, step))
    # a lag of about 1 / (1 - decay) steps of change (0.028 each) plus sampling noise
    assert max(errors[5:]) < 0.15 and sum(errors[5:]) / 25 < 0.1
    stale = V0Predictor(history=1000, decay=1.0)  # without decay it lags far behind
    rng = random.Random(1)
    for step in range(30):
        stale.observe(_history(rng, {"add": 0.1 + 0.8 * step / 29}, 16, step))
    assert abs(stale.predict([_prompt("add", rng)], 29)[0] - 0.9) > 0.3


def test_brier_and_auc_against_hand_computations():
    preds, ys = [0.9, 0.9, 0.2, 0.5, 0.5], [1, 0, 0, 1, 0]
    assert brier(preds, ys) == pytest.approx((0.01 + 0.81 + 0.04 + 0.25 + 0.25) / 5)
    pos = [p for p, y in zip(preds, ys) if y]
    neg = [p for p, y in zip(preds, ys) if not y]
    naive = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg) / \
        (len(pos) * len(neg))
    assert auc(preds, ys) == pytest.approx(naive)
    assert auc([0.3, 0.4], [1, 1]) is None


def test_route_takes_the_best_success_per_cost():
    preds = {"small": 0.6, "large": 0.9}
    assert route(preds, {"small": 1.0, "large": 10.0}, 0.01) == "large"
    assert route(preds, {"small": 1.0, "large": 10.0}, 0.1) == "small"
    with pytest.raises(ValueError, match="no cost"):
        route(preds, {"small": 1.0}, 0.1)


def _group(pid: str, prompt: str, rewards: list[int]) -> Group:
    samples = [Sample(prompt_id=pid, prompt_ids=[1], response_ids=[2]) for _ in rewards]
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    return Group(pid, samples, Problem(id=pid, prompt=prompt, answer="1"))


def test_sizer_allocates_by_predicted_variance_and_reports_calibration():
    cfg = load_config(None, ["control.group_size=v0", "generate.group_size=8"])
    sizer = V0(cfg)
    rng = random.Random(2)
    sizer.observe([_group(f"h{i}", _prompt(k, rng), [1] * 8 if k == "add" else [1, 0] * 4)
                   for i, k in enumerate(["add", "mul"] * 20)], 0)
    problems = [Problem(id="a", prompt=_prompt("add", rng), answer="1"),
                Problem(id="m", prompt=_prompt("mul", rng), answer="1")]
    preds = sizer.predictor.predict([p.prompt for p in problems], 1)
    sizes = sizer.sizes(problems, 1)
    assert sizes == proportional_sizes([q * (1 - q) for q in preds], 16, 2, 16)
    assert sizes[1] > sizes[0]  # the mixed family gets more
    sizer.observe([_group("a", problems[0].prompt, [1] * sizes[0]),
                   _group("m", problems[1].prompt, [1, 0] * (sizes[1] // 2))], 1)
    ys = [1] * sizes[0] + [1, 0] * (sizes[1] // 2)
    qs = [preds[0]] * sizes[0] + [preds[1]] * sizes[1]
    m = sizer.metrics()
    assert m["control/v0/brier"] == pytest.approx(brier(qs, ys))
    assert m["control/v0/brier"] < m["control/v0/brier_const"]
    assert m["control/v0/auc"] == pytest.approx(auc(qs, ys))
    restored = V0(cfg)
    restored.load_state_dict(sizer.state_dict())
    assert restored.predictor.predict(["What is 1 plus 2?"], 3) == \
        sizer.predictor.predict(["What is 1 plus 2?"], 3)
