"""Checkpoints: atomic writes (a kill mid-write leaves the previous checkpoint as the newest
intact one), keep-last-K, damage detection, and state that restores exactly: RNGs, the
trainer, and whole runs with every stateful part switched on (replay buffer, DPS, curriculum,
KL reference, version snapshots; APRIL's paused partial rollouts)."""

import copy
import io
import os
import random
import shutil
import signal

import numpy as np
import pytest
import torch
from loop_helpers import SMALL
from train_helpers import make_groups

from rollwise.bench.crash import compare
from rollwise.config import TrainConfig, load_config
from rollwise.loop.run import train
from rollwise.store import checkpoint as ckpt
from rollwise.store.killpoint import ENV
from rollwise.training.trainer import Trainer


def test_save_keeps_the_last_k_and_each_loads_back(tmp_path):
    for step in (2, 4, 6, 8):
        ckpt.save(tmp_path, step, {"step": step, "w": torch.arange(step)}, keep=3)
    assert [c.step for c in ckpt.listing(tmp_path)] == [4, 6, 8]
    newest = ckpt.latest(tmp_path)
    assert newest.step == 8 and torch.equal(newest.load()["w"], torch.arange(8))
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta", "no_state"])
def test_damaged_checkpoint_is_reported_and_skipped(tmp_path, damage):
    for step in (1, 2):
        ckpt.save(tmp_path, step, {"x": torch.ones(1000) * step}, keep=5)
    path = ckpt.listing(tmp_path)[-1].path
    state = path / "state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 1
        state.write_bytes(bytes(data))
    else:
        (path / ("meta.json" if damage == "no_meta" else "state.pt")).unlink()
    assert ckpt.problem(path) is not None
    logged = []
    assert ckpt.latest(tmp_path, log=logged.append).step == 1
    assert "damaged" in logged[0]
    ckpt.clean(tmp_path, after_step=1)
    assert [c.step for c in ckpt.listing(tmp_path)] == [1]


def test_a_kill_during_the_write_leaves_the_previous_checkpoint_newest(tmp_path):
    ckpt.save(tmp_path, 1, {"x": torch.zeros(10_000)})
    pid = os.fork()
    if pid == 0:
        os.environ[ENV] = "checkpoint:2"
        try:
            ckpt.save(tmp_path, 2, {"x": torch.ones(10_000)})
        finally:
            os._exit(0)  # not reached when the kill fires
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL
    partial = list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert partial and (partial[0] / "state.pt").stat().st_size > 0
    lines = []
    assert ckpt.latest(tmp_path, lines.append).step == 1
    (tmp_path / "checkpoints" / "step-000003").mkdir()  # a newer one, damaged
    ckpt.clean(tmp_path, after_step=1, log=lines.append)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [c.step for c in ckpt.listing(tmp_path)] == [1]
    said = "\n".join(lines)  # which were discarded, and why
    assert "discarded .tmp-step-000002: a checkpoint whose write was interrupted" in said
    assert "discarded step-000003: newer than the checkpoint resumed from" in said
    assert "FileNotFoundError" in said


def draws(rng: random.Random) -> list:
    return [rng.random(), random.random(), float(np.random.rand()), float(torch.rand(1))]


def test_rng_state_restores_every_generator():
    rng = random.Random(5)
    draws(rng)
    state = ckpt.rng_state(rng)
    first = draws(rng)
    draws(rng)
    ckpt.set_rng_state(state, rng)
    assert draws(rng) == first


def test_trainer_state_restores_the_next_update_exactly(tiny):
    model, tok = tiny
    cfg = TrainConfig(lr=1e-2, minibatches=2, steps=10, kl_coef=0.05)
    cfg.correction.snapshots = 2
    groups = make_groups(model, tok, n_prompts=2, group_size=4)
    a = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=3)
    a.update(groups)
    state = ckpt.trainer_state(a)
    buf = io.BytesIO()
    torch.save(state, buf)  # as a checkpoint stores it
    m_a = a.update(groups)
    b = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=3)
    ckpt.set_trainer_state(b, torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    m_b = b.update(groups)
    assert m_a == m_b and a.version == b.version == 2
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), k
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()


@pytest.mark.integration
@pytest.mark.parametrize("name, extra", [
    ("replay", ["replay.enabled=true", "replay.max_staleness=2", "control.selector=dps",
                "replay.curriculum=frontier", "train.correction.mode=tis",
                "train.correction.snapshots=2", "train.kl_coef=0.01"]),
    ("inflight", ["control.inflight=april", "control.selector=thompson",
                  "generate.max_new_tokens=12"]),
    # the posterior selectors on a pool small enough that prompts recur
    ("selector", ["control.selector=vade", "task.train_size=24"]),
    ("selector", ["control.selector=insight", "task.train_size=24"]),
    # CurES's counts and gradient norms, V0's history, the seeding bank and streaks
    ("group_size", ["control.selector=cures", "control.group_size=cures",
                    "task.train_size=24"]),
    ("group_size", ["control.group_size=v0", "task.train_size=24"]),
    ("icl_seeding", ["control.icl_seeding.exemplars=1", "control.icl_seeding.after=1",
                     "task.train_size=24"]),
    # MSSR: one rollout a prompt, each sample's baseline from the checkpointed tracker
    ("baseline", ["generate.group_size=1", "train.advantage=mssr", "control.baseline=running",
                  "filter.drop_equal_reward_groups=false", "train.token_shaping=entropy",
                  "task.train_size=24"]),
    # SCOPE and NudgeRL keep no state of their own: rectification follows the scored
    # groups, and the contexts are drawn from the run's seed, the step and the prompt
    ("trainer", ["generate.scope.verifier=columns", "generate.scope.max_solved=1.0",
                 "task.tiers={add2s: 1.0}", "generate.max_new_tokens=40",
                 "filter.reward=exact", "model.max_positions=64"]),
    ("trainer", ["generate.strategy=nudge", "generate.nudge.contexts=[c1, c2, c3]",
                 "train.advantage=nudge"]),
    # an engine in a child process: its seed stream is saved through the engine's state API
    ("engine", ["sync.transport=process"]),
])
def test_a_run_resumed_from_a_middle_checkpoint_equals_the_uninterrupted_one(tmp_path, name,
                                                                             extra):
    cfg = load_config(None, SMALL + extra + [f"run.root={tmp_path}", "run.name=ref"])
    train(cfg)
    shutil.copytree(tmp_path / "ref", tmp_path / "resumed")
    shutil.rmtree(ckpt.listing(tmp_path / "resumed")[-1].path)  # resume from step 4 of 6
    state = ckpt.latest(tmp_path / "resumed").load()
    assert state[name]  # the part under test is saved
    train(load_config(tmp_path / "resumed" / "config.yaml", ["run.name=resumed"]), resume=True)
    assert compare(tmp_path / "ref", tmp_path / "resumed") == []


def test_first_ctrl_c_asks_to_stop_and_the_second_interrupts():
    logged = []
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    with ckpt.StopOnInterrupt(logged.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and "finishing this step" in logged[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # restored as it was
