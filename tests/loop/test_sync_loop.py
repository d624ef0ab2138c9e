"""`rollwise train` with the engine in a child process (sync.transport=process) trains exactly
as with the engine in-process: the same metrics, step by step, with the same seed."""

import json

import pytest

from rollwise import models
from rollwise.bench.crash import is_measured
from rollwise.config import ModelConfig, load_config
from rollwise.loop.run import train


def even_length(response, problem):
    """A reward a random tiny model earns half the time, so groups have mixed rewards."""
    return float(len(response) % 2 == 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sparse"])
def test_a_run_with_the_engine_in_a_child_process_matches_in_process(tmp_path, mode):
    model, tok = models.build(ModelConfig(hidden_size=64, num_layers=2, num_heads=4,
                                          num_kv_heads=2, intermediate_size=128), seed=0)
    models.save(model, tok, tmp_path / "init")
    metrics = {}
    for transport in ("inproc", "process"):
        cfg = load_config(None, [
            f"model.path={tmp_path / 'init'}", f"filter.reward={__name__}:even_length",
            "train.steps=3", "train.lr=1e-5", "control.prompts_per_step=8",
            "task.eval_size=16", "run.eval_every=2", f"run.root={tmp_path}",
            f"run.name={transport}", "run.log=quiet", "run.report=false",
            f"sync.transport={transport}", f"sync.mode={mode}", "sync.engine_dtype=bfloat16"])
        train(cfg)
        rows = [json.loads(line) for line in open(tmp_path / transport / "metrics.jsonl")]
        metrics[transport] = [{k: v for k, v in r.items()
                               if not is_measured(k)} for r in rows]
    assert metrics["inproc"] == metrics["process"]
    trained = [r for r in metrics["process"] if "train/loss" in r]
    assert len(trained) == 3 and all(r["sync/sparse"] == 1.0 for r in trained[1:])
    assert metrics["process"][-1]["policy/version"] == 3


@pytest.mark.integration
def test_the_engine_process_ends_with_the_run_on_every_path(tmp_path, monkeypatch):
    """A finished run and one that fails mid-step both leave no engine process behind: the
    run closes what it started (Run is a context manager)."""
    import multiprocessing

    from rollwise.loop import run as loop_sync
    model, tok = models.build(ModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=1, intermediate_size=64), seed=0)
    models.save(model, tok, tmp_path / "init")

    def config(name):
        return load_config(None, [
            f"model.path={tmp_path / 'init'}", f"filter.reward={__name__}:even_length",
            "train.steps=1", "control.prompts_per_step=2", "generate.group_size=2",
            "task.eval_size=4", f"run.root={tmp_path}", f"run.name={name}", "run.log=quiet",
            "run.report=false", "sync.transport=process"])
    train(config("finished"))
    assert multiprocessing.active_children() == []

    def fail(self, step):
        assert multiprocessing.active_children(), "the engine process should be running here"
        raise RuntimeError("a step fails")
    monkeypatch.setattr(loop_sync.Run, "produce", fail)
    with pytest.raises(RuntimeError, match="a step fails"):
        train(config("failed"))
    assert multiprocessing.active_children() == []
