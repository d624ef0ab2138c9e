"""A module outside rollwise/ (tests/extension_plugin.py) plugs a generator, a selector, an
in-flight controller and a verifier into a 3-step run by dotted path, and an episodic task and
generator with their own evaluation and warm start: no edit to rollwise/."""

import json

import extension_plugin as plugin
import pyarrow.compute as pc
import pytest

from rollwise import models
from rollwise.cli import main
from rollwise.config import load_config
from rollwise.loop.run import train
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


def dialogue_cfg(tmp_path, *extra):
    return load_config(None, [
        f"task.name={PLUGIN}:DialogueTask", f"generate.strategy={PLUGIN}:DialogueGenerator",
        f"run.root={tmp_path}", "run.log=quiet", "run.report=false", "train.steps=2",
        "run.eval_every=2", "task.eval_size=6", "sft.steps=4", "sft.batch_size=8",
        "control.prompts_per_step=2", "generate.group_size=2", "generate.max_new_tokens=3",
        "filter.workers=0", *extra])


def test_an_episodic_plugin_owns_its_evaluation_and_warm_start(tmp_path, capsys):
    """A task played as dialogues, and the plugin generator that plays them: the warm start
    trains on the generator's own examples, training and `rollwise eval` evaluate with its
    own evaluation, and the environment's turn is stored untrained. No edit to rollwise/."""
    plugin.WARM_CALLS.clear()
    train(dialogue_cfg(tmp_path), Progress("quiet", 2))
    assert plugin.WARM_CALLS and plugin.WARM_CALLS[-1] == 64  # its examples, one per problem
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").open()]
    evals = [m for m in rows if "eval/pass1" in m]
    assert evals and all(m["eval/dialogues"] == 6 for m in evals)  # its evaluation's metric
    table = RolloutStore(tmp_path / "default" / "rollouts").read()
    nudge = len(tiny_tokenizer()(plugin.NUDGE)["input_ids"])
    masks = [m for m, r in zip(table["loss_mask"].to_pylist(), table["response_ids"].to_pylist())
             if len(r) > 3]  # dialogues that reached a second turn
    assert masks and all(m.count(0) == nudge for m in masks)
    assert main(["eval", "--model", str(tmp_path / "default" / "model")]) == 0
    assert json.loads(capsys.readouterr().out)["eval/dialogues"] == 6


def test_a_task_played_as_dialogues_refuses_a_plain_generator(tmp_path):
    with pytest.raises(ValueError, match="played as dialogues.*generate.strategy=group"):
        train(dialogue_cfg(tmp_path, "generate.strategy=group"), Progress("quiet", 2))
    assert not (tmp_path / "default").exists()  # refused before any work


def tiny_tokenizer():
    return models.char_tokenizer()
