"""Crash test: a run SIGKILLed at chosen points (during generation, the store's write-ahead log,
the Parquet write, the optimizer update, a checkpoint write) and resumed after each kill equals
an uninterrupted run of the same seed: every metric but timings at every step, every rollout
stored exactly once with equal content, equal final weights, no damaged checkpoint.

The children are forked from this process (already importing torch costs ~10 s a time here)
and run the CLI's main(); `rollwise bench crash` does the same at full size with fresh
`python -m rollwise` processes and random kill times.
"""

import json
import os
import shutil
import signal

import pytest
from loop_helpers import SMALL, fork_main

from rollwise.bench.crash import compare, metric_rows
from rollwise.cli import main
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.store import checkpoint as ckpt


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    train(load_config(None, SMALL + [f"run.root={root}", "run.name=reference"]))
    return root


@pytest.mark.integration
def test_killed_anywhere_and_resumed_equals_the_uninterrupted_run(reference):
    root, run = reference, reference / "crashed"
    resume = ["train", "--resume", str(run)]
    # (kill point, the newest intact checkpoint when it fires)
    chain = [("generate:2", None),  # before the first checkpoint: the resume starts over
             ("wal:3", 2), ("store:4", 2), ("train:5", 4), ("checkpoint:6", 4)]
    for i, (at, newest) in enumerate(chain):
        argv = ["train", *SMALL, f"run.root={root}", "run.name=crashed"] if i == 0 else resume
        assert fork_main(argv, at) == -signal.SIGKILL, f"the kill at {at} did not fire"
        found = ckpt.latest(run, log=lambda _: None)
        assert (found.step if found else None) == newest, at
    # what the last kills left behind: a torn checkpoint, a rollout log and metrics of step 6
    assert list((run / "checkpoints").glob(".tmp-*"))
    assert [r["step"] for r in metric_rows(run)][-1] == 6
    assert fork_main(resume) == 0
    assert compare(reference / "reference", run) == []
    summary = json.loads((run / "summary.json").read_text())
    expected = json.loads((reference / "reference" / "summary.json").read_text())
    for k in ("rollouts", "tokens_generated", "tokens_trained", "eval_end", "eval_start"):
        assert summary[k] == expected[k], k


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_finishes_the_step_saves_and_resumes_exactly(reference, sig):
    """Ctrl-C, or the SIGTERM a scheduler sends before it kills: the step in progress
    finishes, a checkpoint is saved, the process exits 128 + the signal, and the resume
    equals the uninterrupted run."""
    root, run = reference, reference / f"interrupted-{sig.name}"

    def interrupt_in_step_3(n):
        if n == 3:
            os.kill(os.getpid(), sig)  # arrives while step 3 runs

    argv = ["train", *SMALL, f"run.root={root}", f"run.name=interrupted-{sig.name}"]
    assert fork_main(argv, before_step=interrupt_in_step_3) == 128 + sig
    assert [c.step for c in ckpt.listing(run)] == [2, 3]  # step 3 finished and was saved
    assert [r["step"] for r in metric_rows(run)] == [0, 1, 2, 3]
    assert not (run / "summary.json").exists()
    assert fork_main(["train", "--resume", str(run)]) == 0
    assert compare(reference / "reference", run) == []


@pytest.mark.integration
def test_resume_without_a_checkpoint_starts_over_and_bad_runs_are_refused(reference, capsys):
    run = reference / "fresh"
    argv = ["train", *SMALL, f"run.root={reference}", "run.name=fresh"]
    assert fork_main(argv, "generate:1") == -signal.SIGKILL
    assert ckpt.latest(run, log=lambda _: None) is None
    assert fork_main(["train", "--resume", str(run)]) == 0
    assert compare(reference / "reference", run) == []
    shutil.rmtree(run)
    assert main(["train", "--resume", str(run)]) == 2
    assert "no config.yaml there" in capsys.readouterr().err


@pytest.mark.integration
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(reference):
    run = reference / "damaged"
    shutil.copytree(reference / "reference", run)
    newest = ckpt.listing(run)[-1]
    state = newest.path / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # e.g. a disk that lost the tail
    logged = []
    found = ckpt.latest(run, log=logged.append)
    assert found.step == newest.step - 2 and "damaged" in logged[0]
    assert fork_main(["train", "--resume", str(run)]) == 0
    assert compare(reference / "reference", run) == []


@pytest.mark.slow
def test_crash_bench_with_fresh_interpreters_and_random_kill_times(tmp_path, capsys):
    """The benchmark's path: `python -m rollwise` children, named and timed kills."""
    from rollwise.bench.crash import main as crash_main
    argv = ["--kills", "4", "--root", str(tmp_path), "--json", *SMALL, "train.steps=8"]
    assert crash_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] and result["kill_points_tried"] == 4


@pytest.mark.integration
def test_a_full_disk_is_said_with_the_run_directory_and_the_resume_command(tmp_path, capsys,
                                                                           monkeypatch):
    """ENOSPC while a checkpoint is written: exit 1 with one line naming the run's directory,
    the free space and the resume command (no bare traceback); the resume finishes the run."""
    import errno

    real_save = ckpt.save

    def disk_full_at_step_4(run_dir, step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(run_dir, step, *args, **kwargs)
    monkeypatch.setattr(ckpt, "save", disk_full_at_step_4)
    argv = ["train", *SMALL, f"run.root={tmp_path}", "run.name=full"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"no space left on the device holding {tmp_path / 'full'}" in err
    assert f"rollwise train --resume {tmp_path / 'full'}" in err and "Traceback" not in err
    monkeypatch.setattr(ckpt, "save", real_save)
    assert main(["train", "--resume", str(tmp_path / "full")]) == 0
    assert [r["step"] for r in metric_rows(tmp_path / "full")] == list(range(7))
