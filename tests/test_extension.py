"""A module outside rollwise/ (tests/extension_plugin.py) plugs a generator, a selector, an
in-flight controller and a verifier into a 3-step run by dotted path: no edit to rollwise/."""

import json

import pyarrow.compute as pc

from rollwise import models
from rollwise.config import load_config
from rollwise.loop.sync import train
from rollwise.report.progress import Progress
from rollwise.store.rollouts import RolloutStore

PLUGIN = "extension_plugin"


def test_a_run_uses_plugins_named_by_dotted_path(tmp_path, tiny):
    models.save(*tiny, tmp_path / "init")
    cfg = load_config(None, [
        f"generate.strategy={PLUGIN}:HintedGenerator", f"control.selector={PLUGIN}:EvenSelector",
        f"control.inflight={PLUGIN}:CapAtTwo", f"filter.reward={PLUGIN}:FirstDigit",
        f"run.init={tmp_path / 'init'}", f"run.root={tmp_path}", "run.log=quiet",
        "run.report=false", "train.steps=3", "control.prompts_per_step=4",
        "generate.group_size=4", "generate.max_new_tokens=6", "task.eval_size=8",
        "filter.workers=0", "engine.segment=1"])
    summary = train(cfg, Progress("quiet", 3))
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").open()][1:]
    assert len(rows) == 3
    for m in rows:
        assert m[f"decisions/control/select/{PLUGIN}:EvenSelector"] == 4
        assert m["decisions/control/abort/cap"] > 0  # the controller's decisions, counted
        assert m["groups/scored"] == 4
    table = RolloutStore(tmp_path / "default" / "rollouts").read()
    assert table.num_rows == 3 * 4 * 4
    assert all(pid[-1] in "02468" for pid in table["prompt_id"].to_pylist())  # the selector
    assert all(t.startswith("? ") for t in
               (tiny[1].decode(ids) for ids in table["prompt_ids"].to_pylist()))  # generator
    assert pc.max(pc.list_value_length(table["response_ids"])).as_py() <= 3  # the cap
    assert all(set(json.loads(r)) == {"first_digit"} for r in table["rewards"].to_pylist())
