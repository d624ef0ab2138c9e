"""Metric sinks: jsonl always, TensorBoard read back from its event files, W&B through a
stand-in module, a user sink by import path, and failure handling."""

import json
import math
import sys
import types

import pytest

from rollwise.config import load_config
from rollwise.report import sinks as S

ROWS = [(1, {"reward/mean": 0.25, "tokens/generated": 40, "note": "text", "flag": True}),
        (2, {"reward/mean": 0.5, "tokens/generated": 38, "bad": float("nan")})]


class RecordingSink:
    """A user sink, imported by path from run.sinks (as another module object than this
    test's, so it reports through a file in the run directory)."""

    def __init__(self, run_dir, cfg):
        self.run_dir, self.seed, self.rows = run_dir, cfg.run.seed, []

    def write(self, step, metrics):
        self.rows.append([step, dict(metrics)])

    def close(self):
        (self.run_dir / "user_sink.json").write_text(json.dumps({"seed": self.seed,
                                                                 "rows": self.rows}))


def not_a_sink(run_dir, cfg):
    return object()


class Exploding:
    def write(self, step, metrics):
        raise OSError("disk full")

    def close(self):
        pass


def cfg_with(*overrides):
    return load_config(None, ["run.tensorboard=false", *overrides])


def test_scalars_keep_finite_numbers_only():
    out = S.scalars({"a": 1, "b": 2.5, "c": True, "d": "x", "e": float("nan"),
                     "f": float("inf"), "g": None})
    assert out == {"a": 1.0, "b": 2.5, "c": 1.0}


def test_jsonl_rows_are_on_disk_after_each_write(tmp_path):
    sink = S.JsonlSink(tmp_path / "m.jsonl")
    sink.write(*ROWS[0])
    on_disk = [json.loads(x) for x in open(tmp_path / "m.jsonl")]  # before close: flushed
    assert on_disk == [{"step": 1, **ROWS[0][1]}]
    sink.write(*ROWS[1])
    sink.close()
    back = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert back[1]["step"] == 2 and math.isnan(back[1]["bad"])


def test_user_sink_by_import_path_gets_every_row(tmp_path):
    cfg = cfg_with("run.seed=7", "run.sinks=[test_report_sinks:RecordingSink]")
    sinks = S.build_sinks(cfg, tmp_path)
    for step, m in ROWS:
        sinks.write(step, m)
    sinks.close()
    got = json.loads((tmp_path / "user_sink.json").read_text())  # written by close()
    assert got["seed"] == 7
    assert got["rows"][0] == [1, ROWS[0][1]]
    (step, m), expected = got["rows"][1], ROWS[1][1]
    assert step == 2 and math.isnan(m.pop("bad"))
    assert m == {k: v for k, v in expected.items() if k != "bad"}
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 2


@pytest.mark.parametrize("path, message", [
    ("test_report_sinks:not_a_sink", "lacks write(step, metrics) and close()"),
    ("test_report_sinks:Missing", "run.sinks: cannot import"),
    ("no_colon_here", "package.module:function"),
])
def test_bad_user_sink_names_the_field(tmp_path, path, message):
    with pytest.raises(ValueError, match="run.sinks") as err:
        S.build_sinks(cfg_with(f"run.sinks=[{path}]"), tmp_path)
    assert message in str(err.value)


def test_failing_optional_sink_is_dropped_and_jsonl_goes_on(tmp_path):
    logged = []
    sinks = S.Sinks(S.JsonlSink(tmp_path / "m.jsonl"), [Exploding()], log=logged.append)
    for step, m in ROWS:
        sinks.write(step, m)
    sinks.close()
    assert len(logged) == 1 and "Exploding failed and is dropped" in logged[0]
    assert "disk full" in logged[0]
    assert [json.loads(x)["step"] for x in open(tmp_path / "m.jsonl")] == [1, 2]


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sinks = S.build_sinks(load_config(None, []), tmp_path)
    assert any(isinstance(s, S.TensorBoardSink) for s in sinks.extra)
    for step, m in ROWS:
        sinks.write(step, m)
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "tokens/generated", "flag"} <= tags
    assert "note" not in tags and "bad" not in tags  # strings and NaN are not scalars
    got = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert got == [(1, 0.25), (2, 0.5)]


def test_tensorboard_off_writes_no_event_files(tmp_path):
    sinks = S.build_sinks(cfg_with(), tmp_path)
    sinks.write(*ROWS[0])
    sinks.close()
    assert not (tmp_path / "tensorboard").exists() and sinks.extra == []


def fake_wandb(calls):
    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()
    module = types.ModuleType("wandb")
    module.init = init
    module.__spec__ = types.SimpleNamespace(name="wandb")  # find_spec sees it installed
    return module


def test_wandb_only_when_asked_and_logs_numbers(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    S.build_sinks(cfg_with(), tmp_path).close()
    assert calls == []  # installed but not asked for
    sinks = S.build_sinks(cfg_with("run.wandb=true", "run.wandb_project=p", "run.name=r1"),
                          tmp_path)
    for step, m in ROWS:
        sinks.write(step, m)
    sinks.close()
    init = calls[0][1]
    assert init["project"] == "p" and init["name"] == "r1"
    assert init["config"]["run"]["name"] == "r1"  # the whole config travels
    assert calls[1] == ("log", 1, {"reward/mean": 0.25, "tokens/generated": 40.0, "flag": 1.0})
    assert calls[2][1] == 2 and "bad" not in calls[2][2]
    assert calls[-1] == ("finish",)


def test_wandb_asked_but_missing_is_skipped_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec -> None: not installed
    logged = []
    sinks = S.build_sinks(cfg_with("run.wandb=true"), tmp_path, log=logged.append)
    sinks.close()
    assert sinks.extra == [] and "pip install wandb" in logged[0]


def test_the_metrics_reach_the_disk_before_each_checkpoint(tmp_path, tiny, monkeypatch):
    """metrics.jsonl is fsynced before every checkpoint is written, so a power loss never
    leaves it without a row of a step a resume would start after."""
    from rollwise import models
    from rollwise.loop.run import train
    from rollwise.store import checkpoint as ckpt
    events: list[str] = []
    real_sync, real_save = S.JsonlSink.sync, ckpt.save
    monkeypatch.setattr(S.JsonlSink, "sync", lambda self: (events.append("fsync"),
                                                           real_sync(self))[1])
    monkeypatch.setattr(ckpt, "save", lambda *a, **k: (events.append("checkpoint"),
                                                        real_save(*a, **k))[1])
    models.save(*tiny, tmp_path / "init")
    train(cfg_with(f"run.init={tmp_path / 'init'}", f"run.root={tmp_path}", "run.log=quiet",
                   "run.report=false", "train.steps=4", "run.checkpoint_every=2",
                   "control.prompts_per_step=2", "generate.group_size=2",
                   "generate.max_new_tokens=4", "task.eval_size=4", "filter.workers=0"))
    assert events == ["fsync", "checkpoint", "fsync", "checkpoint"]  # steps 2 and 4
