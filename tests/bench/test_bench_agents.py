"""`rollwise bench agents` end to end on a small model and 2 steps per arm: the top-level keys
the issue names, computed from the runs' own metrics."""

import json
import math

import pytest
from loop_helpers import SMALL

from rollwise.bench import agents


# runs the agents bench on the tiny model: integration
@pytest.mark.integration
def test_bench_agents_reports_its_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(agents, "TOOL_STEPS", 2)
    monkeypatch.setattr(agents, "COD_STEPS", 2)
    monkeypatch.setattr(agents, "TRACE_STEPS", 2)
    small = [o for o in SMALL if not o.startswith(("filter.reward", "train.steps",
                                                   "run.eval_every", "task.eval_size",
                                                   "generate.group_size"))]
    assert agents.main(["--seeds", "0", "--json", "--root", str(tmp_path), *small,
                        "task.eval_size=8", "control.prompts_per_step=3",
                        "run.eval_samples=1", "run.eval_temperature=0"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("tool_success_delta", "cod_position_slope", "cod_shuffled_slope"):
        assert isinstance(out[key], float) and not math.isnan(out[key]), key
    tool, = out["runs"]["tool"]
    assert out["tool_success_delta"] == tool["end"] - tool["start"]
    trace, = out["runs"]["trace"]
    for arm in ("trace", "root"):
        t = trace[arm]
        assert t["sampled_tokens"] > 0 and t["mixed_sets"] <= t["sibling_sets"]
        assert t["mixed_per_1k_tokens"] == 1000 * t["mixed_sets"] / t["sampled_tokens"]
        assert len(t["curve"]) == 3  # evaluated at the start and after each step
        for target, step in t["steps_to"].items():
            assert step == next((i for i, p in enumerate(t["curve"]) if p >= float(target)),
                                None)
    # a ratio of the two (nan when neither found a mixed set: an untrained model may not)
    assert out["trace_mixed_ratio"] == agents.ratio(trace["trace"]["mixed_per_1k_tokens"],
                                                    trace["root"]["mixed_per_1k_tokens"]) \
        or (math.isnan(out["trace_mixed_ratio"]) and trace["root"]["mixed_sets"] == 0)
    for target, counts in out["trace_earlier"].items():  # one seed: exactly one of the three
        a, b = (trace[arm]["steps_to"][target] for arm in ("trace", "root"))
        a, b = (math.inf if n is None else n for n in (a, b))
        assert counts == {"fewer": int(a < b), "same": int(a == b), "more": int(a > b)}
    assert "| seed |" in agents.markdown(out)
    # --arms runs some of the arms: the others' keys are nan
    assert agents.main(["--seeds", "0", "--json", "--arms", "trace", "--root", str(tmp_path),
                        *small, "task.eval_size=8", "control.prompts_per_step=3",
                        "run.eval_samples=1", "run.eval_temperature=0"]) == 0
    only = json.loads(capsys.readouterr().out)
    assert math.isnan(only["tool_success_delta"]) and not only["runs"]["tool"]
    for arm in ("trace", "root"):  # the same runs, from the same seed
        assert only["runs"]["trace"][0][arm] == out["runs"]["trace"][0][arm]
    assert "| 0 | – |" in agents.markdown(only)
