"""A pass@1 equal to its target reaches it, whatever the rounding of start + gain; logs
written before that are read with their first reach corrected."""

import json

from rollwise.bench.methods import load_finished
from rollwise.bench.target import first_reach, reaches


def test_an_evaluation_scoring_exactly_the_target_reaches_it():
    target = 0.195 + 0.1  # 0.29500000000000004
    assert 59 / 200 < target  # the rounding the comparison must allow for
    assert reaches(59 / 200, target)
    assert not reaches(58 / 200, target)
    curve = [{"step": 0, "pass1": 0.195}, {"step": 3, "pass1": 0.29},
             {"step": 6, "pass1": 0.295}, {"step": 9, "pass1": 0.31}]
    assert first_reach(curve, target)["step"] == 6
    assert first_reach(curve, 0.195 + 0.2) is None


def _record(**kw):
    curve = [{"step": 0, "tokens": 0, "seconds": 0.0, "pass1": 0.195},
             {"step": 4, "tokens": 400, "seconds": 40.0, "pass1": 0.295},
             {"step": 8, "tokens": 800, "seconds": 80.0, "pass1": 0.31}]
    return {"arm": "grpo", "seed": 0, "settings": "s", "curve": curve, "target": 0.195 + 0.1,
            "rollouts_to_target": 512, **kw}


def test_old_logs_are_read_with_the_first_reach(tmp_path):
    log = tmp_path / "runs.jsonl"
    missed = _record(reached=True, tokens_to_target=800, seconds_to_target=80.0,
                     steps_to_target=8)
    never = _record(reached=False, tokens_to_target=800, seconds_to_target=80.0,
                    steps_to_target=8, seed=1)
    right = _record(reached=True, tokens_to_target=400, seconds_to_target=40.0,
                    steps_to_target=4, seed=2)
    log.write_text("".join(json.dumps(r) + "\n" for r in (missed, never, right)))
    got = {r["seed"]: r for r in load_finished(log, {"grpo": "s"})}
    for seed in (0, 1):
        assert (got[seed]["reached"], got[seed]["steps_to_target"],
                got[seed]["tokens_to_target"], got[seed]["seconds_to_target"]) \
            == (True, 4, 400, 40.0)
        assert got[seed]["rollouts_to_target"] is None  # not in the log: unknown, not stale
    assert got[2] == right
