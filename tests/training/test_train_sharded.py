"""train.world_size=2 (rollwise/training/sharded.py): two FSDP2 ranks (gloo, spawned processes)
give one rank's update within float tolerance, over several optimizer steps with micro-batches
dealt out unevenly; the unsharded state round-trips; the loop runs with it; a dead rank stops
the run with an error naming it."""

import copy
import os
import signal
import time

import pytest
from loop_helpers import SHARDED, SMALL

from rollwise.config import load_config
from rollwise.loop.run import Run, train
from rollwise.report.progress import Progress
from rollwise.training.sharded import ShardedTrainer, TrainerRankError
from rollwise.training.trainer import Trainer

pytestmark = pytest.mark.integration  # whole training loops


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    cfg = load_config(None, SMALL + SHARDED + [f"run.root={tmp_path_factory.mktemp('fsdp')}"])
    run = Run(cfg, Progress("quiet", 2))
    r = run.produce(1)
    assert r.trained, "the step kept no group to train on"
    return cfg, run, r


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_give_one_ranks_update(step):
    cfg, run, r = step
    start = copy.deepcopy(run.trainer.model)
    one = Trainer(copy.deepcopy(start), cfg.train, pad_id=run.tokenizer.pad_token_id, seed=0)
    two = ShardedTrainer(copy.deepcopy(start), cfg.train, pad_id=run.tokenizer.pad_token_id,
                         world_size=2, timeout_s=120)
    try:
        for _ in range(2):
            a, b = one.update(r.trained, r.dropped), two.update(r.trained, r.dropped)
            assert _max_diff(one.weights(), two.weights()) < 1e-5
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
            assert b["train/tokens"] == a["train/tokens"]
        assert _max_diff(start.state_dict(), two.weights()) > 1e-4  # it did move
        assert two.version == one.version == 2
        # the unsharded state: saved, updated past, restored, updated again -> the same
        state = two.state_dict()
        before = two.weights()
        two.update(r.trained, r.dropped)
        two.load_state_dict(state)
        assert _max_diff(before, two.weights()) == 0
        one_copy = copy.deepcopy(one)
        one_copy.update(r.trained, r.dropped)
        two.update(r.trained, r.dropped)
        assert _max_diff(one_copy.weights(), two.weights()) < 1e-5
    finally:
        two.close()


def test_a_dead_rank_stops_with_an_error_naming_it(step):
    cfg, run, r = step
    two = ShardedTrainer(copy.deepcopy(run.trainer.model), cfg.train,
                         pad_id=run.tokenizer.pad_token_id, world_size=2, timeout_s=60)
    try:
        os.kill(two.ranks.procs[1].pid, signal.SIGKILL)
        with pytest.raises(TrainerRankError, match="trainer rank"):
            two.update(r.trained, r.dropped)
    finally:
        two.close()


def test_a_stopped_rank_is_named_within_the_timeout_and_killed_on_close(step):
    """SIGSTOP on rank 1 before an update: the driver does not block on its pipe, the error
    names rank 1 as stopped (not rank 0, which waits for it in a collective) within the
    timeout, and close() ends both ranks."""
    cfg, run, r = step
    two = ShardedTrainer(copy.deepcopy(run.trainer.model), cfg.train,
                         pad_id=run.tokenizer.pad_token_id, world_size=2, timeout_s=5)
    procs = list(two.ranks.procs)
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TrainerRankError, match=rf"trainer rank 1 \(pid {procs[1].pid}, "
                                                   r"stopped \(SIGSTOP"):
            two.update(r.trained, r.dropped)
        assert time.monotonic() - t0 < 15
    finally:
        two.close()
    assert not any(p.is_alive() for p in procs)


def test_the_loop_trains_with_two_ranks(tmp_path):
    summary = train(load_config(None, SMALL + SHARDED + [
        f"run.root={tmp_path}", "train.world_size=2", "train.steps=2"]))
    assert summary["steps"] == 2 and summary["tokens_trained"] > 0


def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_one(tmp_path, monkeypatch):
    """Fresh interpreters (`python -m rollwise`), as a user runs it: the ranks are spawned
    processes, which a child forked from pytest's own process does not start cleanly."""
    from pathlib import Path

    from rollwise.bench.crash import child, compare
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    common = SMALL + SHARDED + ["train.world_size=2", "train.steps=4", f"run.root={tmp_path}"]
    train(load_config(None, common + ["run.name=reference"]))
    log = tmp_path / "children.log"
    assert child(["train", *common, "run.name=killed"], "store:3", log=log) == -signal.SIGKILL
    assert child(["train", "--resume", str(tmp_path / "killed")], log=log) == 0, log.read_text()
    assert compare(tmp_path / "reference", tmp_path / "killed") == []


def test_two_ranks_with_compiled_blocks_give_one_eager_ranks_update(step):
    cfg, run, r = step
    start = copy.deepcopy(run.trainer.model)
    one = Trainer(copy.deepcopy(start), cfg.train, pad_id=run.tokenizer.pad_token_id, seed=0)
    compiled = cfg.train.model_copy(update={"compile_blocks": True})
    two = ShardedTrainer(copy.deepcopy(start), compiled,
                         pad_id=run.tokenizer.pad_token_id, world_size=2, timeout_s=300)
    try:
        one.update(r.trained, r.dropped)
        two.update(r.trained, r.dropped)
        assert _max_diff(one.weights(), two.weights()) < 1e-5
        assert _max_diff(start.state_dict(), two.weights()) > 1e-4
    finally:
        two.close()
