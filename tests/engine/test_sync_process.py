"""An engine in a child process: it generates exactly what the in-process engine generates, and
RL training with its rollouts and sparse syncs through shared memory follows the in-process run
number for number. Refusals cross the process boundary as the same errors; a new engine process
gets a full sync; a dead one is reported, never waited on."""

import copy

import pytest
import torch
from sync_helpers import rl_groups

from rollwise.config import TrainConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.process import EngineProcess
from rollwise.sync import EngineProcessError, StaleEngineError, WeightSync
from rollwise.sync.transport import InProcessTransport, ProcessTransport
from rollwise.training.trainer import Trainer


@pytest.fixture(scope="module")
def proc(tiny):
    model, tok = tiny
    p = EngineProcess(model, dtype=torch.bfloat16, seed=1)
    yield p
    p.close()


@pytest.fixture(scope="module")
def socket_proc(tiny):
    model, tok = tiny
    p = EngineProcess(model, dtype=torch.bfloat16, seed=1, wire="socket")
    yield p
    p.close()


def in_process_engine(model, tok):
    engine = BuiltinEngine(model, seed=1)
    engine.model.to(torch.bfloat16)
    return engine


def requests(tok, seed=0):
    return [Request(tok(p)["input_ids"], SamplingParams(max_new_tokens=6, seed=seed + i), i)
            for i, p in enumerate(["12+34=", "7-5=", "3+3="])]


def test_child_engine_generates_what_the_in_process_engine_generates(tiny, proc):
    model, tok = tiny
    ours = in_process_engine(model, tok).generate(requests(tok))
    theirs = proc.generate(requests(tok))
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.logprobs for c in ours] == [c.logprobs for c in theirs]
    assert proc.tokens_generated >= sum(len(c.token_ids) for c in theirs)
    assert proc.has_unfinished() is False  # other engine methods run in the child
    with pytest.raises(AttributeError, match="child process"):
        proc.model
    with pytest.raises(AttributeError, match="only the engine's methods"):
        proc.no_such_method


def test_rl_with_a_child_engine_matches_in_process_exactly(tiny, proc, socket_proc):
    model, tok = tiny
    runs = {}
    for where in ("inproc", "process", "socket"):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(lr=1e-5, steps=10),
                          pad_id=tok.pad_token_id, seed=0)
        if where == "inproc":
            engine = in_process_engine(model, tok)
            transport = InProcessTransport(engine)
        else:
            engine = proc if where == "process" else socket_proc
            engine.load_weights(model.state_dict(), 0)  # the module's engine may have moved on
            transport = ProcessTransport(engine)
        sync = WeightSync(trainer, transport, mode="sparse", check=True)
        sync.push()
        log = []
        for step in range(3):
            groups = rl_groups(engine, tok, seed=100 * step)
            log.append([s.response_ids for g in groups for s in g.samples])
            log.append(trainer.update(groups))
            m = sync.push()
            log.append({k: v for k, v in m.items() if "seconds" not in k})
        runs[where] = log
    assert runs["inproc"] == runs["process"] == runs["socket"]
    last = runs["process"][-1]
    assert last["sync/sparse"] == 1.0 and 0 < last["sync/density"] < 0.5  # it trained
    assert "train/loss" in runs["process"][-2]


def test_refusals_cross_the_process_boundary_and_a_new_engine_gets_a_full_sync(tiny, proc):
    model, tok = tiny
    trainer = Trainer(copy.deepcopy(model), TrainConfig(lr=1e-5), pad_id=tok.pad_token_id)
    sync = WeightSync(trainer, ProcessTransport(proc), mode="sparse")
    sync.push()
    trainer.update(rl_groups(proc, tok, seed=7))
    meta, _ = sync.sender.encode(trainer.weights(), trainer.version, proc.arena, full=False)
    meta.base_version = 99
    with pytest.raises(StaleEngineError, match="applies to version 99"):
        proc.apply(meta)
    assert proc.version == 0  # refused before any write
    sync.sender.reset()
    second = EngineProcess(model, dtype=torch.bfloat16, seed=1)
    try:
        sync.push()  # full to `proc`; now the sender has a mirror ...
        sync.transport = ProcessTransport(second)  # ... that a new engine does not hold
        trainer.update(rl_groups(proc, tok, seed=8))
        m = sync.push()
        assert m["sync/fallback_full"] == 1.0 and second.version == trainer.version
        sync.compare()
        second._proc.kill()
        with pytest.raises(EngineProcessError, match="died"):
            second.generate(requests(tok))
    finally:
        second.close()


def test_a_refusal_on_the_socket_wire_leaves_the_pipe_usable(tiny, socket_proc):
    """The payload's bytes are read before it is judged, so a refused payload does not leave
    bytes in the pipe for the next command to misread."""
    model, tok = tiny
    socket_proc.load_weights(model.state_dict(), 0)
    trainer = Trainer(copy.deepcopy(model), TrainConfig(lr=1e-5), pad_id=tok.pad_token_id)
    sync = WeightSync(trainer, ProcessTransport(socket_proc), mode="sparse", check=True)
    sync.push()
    trainer.update(rl_groups(socket_proc, tok, seed=7))
    meta, _ = sync.sender.encode(trainer.weights(), trainer.version, socket_proc.arena,
                                 full=False)
    meta.base_version = 99
    with pytest.raises(StaleEngineError, match="applies to version 99"):
        socket_proc.apply(meta)
    assert socket_proc.version == 0
    sync.sender.reset()
    m = sync.push()  # full, then compared bit for bit (check mode) through the same pipe
    assert m["sync/sparse"] == 0.0 and socket_proc.version == trainer.version
    trainer.update(rl_groups(socket_proc, tok, seed=8))
    assert sync.push()["sync/sparse"] == 1.0


def test_an_engine_process_that_never_starts_is_reported_not_waited_on(tiny, monkeypatch):
    """A child that is alive but never says it is up (here its model's construction hangs;
    in practice, a script without a __main__ guard) is a timeout naming the wait, and the
    child is gone afterwards."""
    from sync_helpers import HangingModel

    from rollwise.engine import process as engine_proc
    model = copy.deepcopy(tiny[0])
    model.__class__ = HangingModel  # what the child builds; the parent's weights are intact
    monkeypatch.setattr(engine_proc, "STARTUP_S", 2.0)
    spawned = []
    real_start = engine_proc.mp.context.SpawnProcess.start
    monkeypatch.setattr(engine_proc.mp.context.SpawnProcess, "start",
                        lambda self: (spawned.append(self), real_start(self))[1])
    with pytest.raises(EngineProcessError, match=r"the engine process \(pid \d+, state \w\) "
                                                 r"did not start \(build its model\) within 2s;"):
        EngineProcess(model)
    assert len(spawned) == 1 and not spawned[0].is_alive()


def test_a_failed_spawn_does_not_hang_on_cleanup(tiny, monkeypatch):
    """When the child cannot be started, the error is raised and the half-built object's
    cleanup returns (it used to wait for a reply on a pipe whose other end it held itself)."""
    import threading

    from rollwise.engine import process as engine_proc

    def refuse(self):
        raise RuntimeError("no processes left")
    monkeypatch.setattr(engine_proc.mp.context.SpawnProcess, "start", refuse)
    outcome = []

    def build_and_drop():
        try:
            EngineProcess(tiny[0])
        except RuntimeError as e:
            outcome.append(str(e))
        import gc
        gc.collect()  # the half-built object's __del__ runs here
        outcome.append("cleaned up")
    t = threading.Thread(target=build_and_drop, daemon=True)
    t.start()
    t.join(30)
    assert outcome == ["no processes left", "cleaned up"]


def test_a_grown_arena_the_child_never_attached_is_unlinked(tiny, monkeypatch):
    """The child stops answering while the arena grows: the call fails within its bound and the
    new shared-memory segment is unlinked with the old, not left in /dev/shm; a later sync to
    the killed child repeats why it is gone and makes no segment."""
    import os
    import signal

    from rollwise.engine import process as engine_proc
    made = []  # (name, size) of each segment this process creates

    def recorded(*args, **kwargs):
        arena = real_arena(*args, **kwargs)
        made.append((arena.name, arena.nbytes))
        return arena
    real_arena = engine_proc.SharedArena
    monkeypatch.setattr(engine_proc, "SharedArena", recorded)
    p = EngineProcess(tiny[0], timeout_s=2.0)
    try:
        p.arena(1024)  # fits in the arena the start's full payload made
        (_, first), = made
        os.kill(p._proc.pid, signal.SIGSTOP)
        with pytest.raises(EngineProcessError, match="did not .* within 2s"):
            p.arena(1 << 20)
        assert [size for _, size in made] == [first, 1 << 20]
        assert not [name for name, _ in made if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]
        with pytest.raises(EngineProcessError, match="it was killed"):
            p.arena(1 << 21)  # the child is gone: no new segment, the first error again
        assert len(made) == 2
    finally:
        p.close()
