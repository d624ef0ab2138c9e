"""The long-answer read-back (rollwise bench long_task): quantiles and the slope against numpy,
and the goals on a run directory written by hand."""

import json
import random

import numpy as np
import pytest

from rollwise.bench import long_task
from rollwise.store.rollouts import RolloutStore
from rollwise.types import Sample, Status


@pytest.mark.parametrize("seed", range(5))
def test_quantiles_and_the_slope_agree_with_numpy(seed):
    rng = random.Random(seed)
    xs = [rng.randint(1, 400) for _ in range(rng.randint(1, 60))]
    for q in (0.1, 0.5, 0.9):
        assert long_task.quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))
    pts = [(float(s), 0.3 + 0.002 * s + rng.gauss(0, 0.02)) for s in range(0, 80, 5)]
    b, se = long_task.slope(pts)
    coef, cov = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1, cov=True)
    assert b == pytest.approx(coef[0]) and se == pytest.approx(float(np.sqrt(cov[0, 0])))
    assert all(np.isnan(v) for v in long_task.slope(pts[:2]))


def write_run(run, lengths_by_step, pass1_by_step, max_new=40):
    store = RolloutStore(run / "rollouts")
    for step, lengths in lengths_by_step.items():
        samples = [Sample(prompt_id="p", prompt_ids=[1], response_ids=[2] * n,
                          status=Status.TRUNCATED if n >= max_new else Status.COMPLETED,
                          reward=float(n % 2)) for n in lengths]
        store.append(step, samples, ["p"] * len(samples), ["r"] * len(samples))
    rows = [{"step": s, "eval/pass1": p, "eval/pass1/terms3-6": p + 0.1}
            for s, p in pass1_by_step.items()]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{torn")


def test_goals_of_a_run_that_keeps_long_answers_and_keeps_learning(tmp_path):
    lengths = {s: [80, 85, 90, 95, 100, 120, 200, 230, 250, 260] for s in range(1, 4)}
    pass1 = {s: 0.2 + 0.001 * s + (0.002 if s % 20 else -0.002) for s in range(0, 70, 10)}
    write_run(tmp_path, lengths, pass1, max_new=250)
    profile, series = long_task.length_profile(tmp_path), long_task.pass1_series(tmp_path)
    assert [p["step"] for p in profile] == [1, 2, 3]
    assert profile[0]["median"] == 110 and profile[0]["truncated"] == 0.2
    assert profile[0]["q90"] == pytest.approx(np.quantile(lengths[1], 0.9))
    assert series[-1] == {"step": 60, "pass1": pass1[60], "terms3-6": pass1[60] + 0.1}
    g = long_task.goals(profile, series, last=30)
    assert g["slope_points"] == 4 and g["long"]
    assert g["slope_last"] > 0 and g["still_learning"]
    assert g["min_spread"] == pytest.approx(251 / 110) and not g["variable"]  # q90 2.28x


def test_a_flat_or_short_run_misses_its_goals(tmp_path):
    write_run(tmp_path, {1: [10, 20, 30, 40, 300]}, {s: 0.3 for s in range(0, 70, 10)})
    g = long_task.goals(long_task.length_profile(tmp_path), long_task.pass1_series(tmp_path), 30)
    assert not g["still_learning"] and not g["long"] and g["min_median"] == 30


def test_a_window_pools_the_steps_it_covers(tmp_path):
    lengths = {s: [10 * s] * 4 for s in range(1, 6)}
    write_run(tmp_path, lengths, {0: 0.1}, max_new=1000)
    rows = long_task.length_profile(tmp_path, window=2)
    assert [(r["step"], r["samples"]) for r in rows] == [(1, 8), (3, 8), (5, 4)]
    assert rows[1]["median"] == 35
    assert rows[1]["q90"] == pytest.approx(np.quantile([30] * 4 + [40] * 4, 0.9))


def test_the_teachers_facts_are_read_back_line_by_line(tmp_path):
    """A run warm-started by the wrong_facts teacher: its pairs come from the saved config,
    and each written line is classed by its own arithmetic."""
    from rollwise.config import dump_config, load_config
    from rollwise.tasks.worked import solution_of

    cfg = load_config(None, ["task.name=worked", "task.worked.teacher=wrong_facts",
                             "task.worked.wrong_facts=30"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    wrong = long_task.teacher_facts(tmp_path)
    assert wrong is not None and len(wrong) == 30
    rng = random.Random(0)
    store, expected = RolloutStore(tmp_path / "rollouts"), []
    for step in (1, 2):
        texts, counts = [], {"teacher": 0, "right": 0, "other": 0, "wrong": 0, "lines": 0}
        for _ in range(12):
            terms = [rng.randint(1, 9) for _ in range(rng.randint(3, 12))]
            text = solution_of(terms, wrong=wrong if rng.random() < 0.5 else None)
            lines = text.splitlines()[:-1]
            if lines and rng.random() < 0.3:  # a line off by 3: a slip of the model's own
                a, rest = lines[-1].rsplit("= ", 1)
                lines[-1] = f"{a}= {int(rest) + 3}"
            for line in lines:  # naive: by the numbers of the line
                a, op, x, _, c = line.split()
                total = int(a) + int(x) if op == "+" else int(a) - int(x)
                off = wrong.get((int(a) % 10, int(x) % 10))
                if off is None:
                    counts["lines"] += 1
                    counts["wrong"] += int(c) != total
                else:
                    key = "right" if int(c) == total else \
                        "teacher" if int(c) - total in (off, abs(off)) else "other"
                    counts[key] += 1
            texts.append("Sure.\n" + "\n".join(lines) + "\n\\boxed{0}")
        samples = [Sample(prompt_id="p", prompt_ids=[1], response_ids=[2]) for _ in texts]
        store.append(step, samples, ["p"] * len(texts), texts)
        expected.append(counts)
    rows = long_task.fact_profile(tmp_path, wrong)
    assert [r["step"] for r in rows] == [1, 2]
    for row, c in zip(rows, expected):
        facts = c["teacher"] + c["right"] + c["other"]
        assert row["fact_lines"] == facts > 0
        assert row["teacher_share"] == pytest.approx(c["teacher"] / facts)
        assert row["fact_right_share"] == pytest.approx(c["right"] / facts)
        assert row["other_wrong_share"] == pytest.approx(c["wrong"] / c["lines"])
    assert rows[0]["teacher_share"] > 0.1  # the teacher's solutions are in there
    (tmp_path / "config.yaml").write_text(dump_config(load_config(None, ["task.name=worked"])))
    assert long_task.teacher_facts(tmp_path) is None  # the slip teacher has no pairs
