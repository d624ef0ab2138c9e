"""run.trim_memory in the loop: the synchronous loop trains with the engine's K/V cache given
back, and the run is the same run bit for bit; the asynchronous loop never frees the engine
under its running producer (only after an evaluation, with the producer parked)."""

import threading

import pytest
from loop_helpers import SMALL

from rollwise.bench.crash import compare
from rollwise.config import load_config
from rollwise.engine.builtin import BuiltinEngine
from rollwise.loop.run import train
from rollwise.training.trainer import Trainer


@pytest.fixture
def watched(monkeypatch):
    """The engine's cache size at each update's start, and each release's circumstances."""
    seen = {"cache_at_update": [], "releases": []}
    engines = []
    init, update, release = (BuiltinEngine.__init__, Trainer.update,
                             BuiltinEngine.release_idle_memory)

    def keep_engine(self, *a, **k):
        init(self, *a, **k)
        engines.append(self)

    def spy_update(self, *a, **k):
        seen["cache_at_update"].append(engines[-1].runner.cache.num_tokens)
        return update(self, *a, **k)

    def spy_release(self):
        seen["releases"].append((threading.current_thread().name, self.has_unfinished()))
        return release(self)
    monkeypatch.setattr(BuiltinEngine, "__init__", keep_engine)
    monkeypatch.setattr(Trainer, "update", spy_update)
    monkeypatch.setattr(BuiltinEngine, "release_idle_memory", spy_release)
    return seen


@pytest.mark.integration
def test_the_synchronous_loop_updates_with_the_cache_given_back(tmp_path, watched):
    train(load_config(None, SMALL + [f"run.root={tmp_path}", "run.name=trim"]))
    assert len(watched["cache_at_update"]) == 6 and set(watched["cache_at_update"]) == {0}
    watched["cache_at_update"].clear()
    watched["releases"].clear()
    train(load_config(None, SMALL + [f"run.root={tmp_path}", "run.name=kept",
                                     "run.trim_memory=false"]))
    kept = watched["cache_at_update"]
    assert len(kept) == 6 and min(kept) > 0 and watched["releases"] == []
    assert compare(tmp_path / "trim", tmp_path / "kept") == []  # every metric, every weight


@pytest.mark.integration
def test_the_asynchronous_loop_frees_the_engine_only_with_its_producer_parked(tmp_path,
                                                                              watched):
    train(load_config(None, SMALL + ["loop.mode=async", "loop.max_staleness=1",
                                     f"run.root={tmp_path}", "run.name=async"]))
    evaluations = 1 + 6 // 2  # step 0 and every run.eval_every=2 steps
    assert len(watched["releases"]) == evaluations
    assert all(thread == "MainThread" and not busy for thread, busy in watched["releases"])
