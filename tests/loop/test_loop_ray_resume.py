"""Kill -9 of a loop.backend=ray driver, then `--resume` (fresh interpreters: each starts and
ends its own local Ray). The synchronous run resumes to the uninterrupted run bit for bit,
because the worker pool's seed stream is checkpointed; the asynchronous one (eta = 2, with
steps generated ahead of the trainer in its checkpoint) writes each step once and stores each
rollout once, within the bound."""

import signal

import pytest

pytest.importorskip("ray")

from loop_helpers import (
    SMALL,  # noqa: E402
    check_resumed,  # noqa: E402
)

from rollwise.bench.crash import child, compare  # noqa: E402

pytestmark = pytest.mark.integration  # whole training loops

RAY = ["loop.backend=ray", "loop.rollout_workers=2", "sync.mode=sparse"]


def test_a_killed_ray_driver_resumes_to_the_uninterrupted_run(tmp_path):
    log = tmp_path / "log.txt"
    common = ["train", *SMALL, *RAY, f"run.root={tmp_path}"]
    assert child([*common, "run.name=whole"], log=log) == 0, log.read_text()
    assert child([*common, "run.name=killed"], "train:3", log=log) == -signal.SIGKILL
    assert child(["train", "--resume", str(tmp_path / "killed")], log=log) == 0, log.read_text()
    assert compare(tmp_path / "whole", tmp_path / "killed") == []


def test_a_killed_asynchronous_ray_driver_loses_and_repeats_nothing(tmp_path):
    log = tmp_path / "log.txt"
    argv = ["train", *SMALL, *RAY, "loop.mode=async", "loop.max_staleness=2",
            "train.correction.mode=tis", f"run.root={tmp_path}", "run.name=killed",
            "run.checkpoint_every=4"]
    assert child(argv, "train:5", log=log) == -signal.SIGKILL
    assert child(["train", "--resume", str(tmp_path / "killed")], log=log) == 0, log.read_text()
    check_resumed(tmp_path / "killed", steps=6, eta=2)
