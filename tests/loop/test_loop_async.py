"""The asynchronous loop (rollwise/loop/async_.py): at max_staleness 0 it is the synchronous loop
bit for bit; at 1 and 2 every trained token is within the bound and keeps the version and
behaviour log-probability it was sampled with, rollouts span weight updates, a kill -9 and a
resume lose and repeat nothing; every wait times out with an error naming what it waited for."""

import io
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from loop_helpers import SMALL, check_resumed, fork_main, rows

from rollwise.bench.crash import compare, metric_rows
from rollwise.config import load_config
from rollwise.loop import run as loop_run
from rollwise.loop.async_ import GatedEngine, Pipeline, WeightGate
from rollwise.loop.metrics import StepResult
from rollwise.loop.run import Run, train
from rollwise.report.progress import Progress
from rollwise.stages.ledger import Ledger

ASYNC = ["loop.mode=async"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    train(load_config(None, SMALL + [f"run.root={root}", "run.name=sync"]))
    return root


@pytest.mark.integration
def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(root):
    train(load_config(None, SMALL + ASYNC + ["loop.max_staleness=0", f"run.root={root}",
                                             "run.name=eta0"]))
    assert compare(root / "sync", root / "eta0") == []


@pytest.mark.integration
@pytest.mark.parametrize("eta", [1, 2])
def test_every_trained_token_is_within_the_bound(root, eta):
    name = f"eta{eta}"
    summary = train(load_config(None, SMALL + ASYNC + [f"loop.max_staleness={eta}",
                                                       f"run.root={root}", f"run.name={name}"]))
    metrics = [m for m in metric_rows(root / name) if m["step"] > 0]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert all(m["policy/version"] == m["step"] for m in metrics)
    assert max(m["staleness/max"] for m in metrics) <= eta
    stored = rows(root / name)
    assert len({r["uid"] for r in stored}) == len(stored) == summary["rollouts"]
    # a stored rollout's versions all lie in [step - 1 - eta, step - 1]
    for r in stored:
        assert r["step"] - 1 - eta <= min(r["versions"]) <= max(r["versions"]) <= r["step"] - 1


def _slow_pipeline_run(cfg):
    """A Run whose engine steps take 20 ms and whose trainer starts updating step k only once
    the producer is generating step k + 1, so weight pushes land mid-rollout."""
    run = Run(cfg, Progress("quiet", cfg.train.steps))
    inner_step = run.engine.step

    def slow_step():
        time.sleep(0.02)
        return inner_step()
    run.engine.step = slow_step
    update = run.trainer.update

    def update_when_next_step_runs(groups, dropped=()):
        step = groups[0].samples[0].step
        t0 = time.time()
        while run.current_step <= step and time.time() - t0 < 5:
            time.sleep(0.005)
        return update(groups, dropped)
    run.trainer.update = update_when_next_step_runs
    return run


def _record_versions_and_batches(run):
    """The weights of every version the trainer pushes, and every batch it trains, as the
    run goes: ({version: state_dict}, [groups of each update])."""
    weights = {0: {k: v.clone() for k, v in run.trainer.model.state_dict().items()}}
    push = run.sync.push

    def push_and_remember():
        out = push()
        weights[run.trainer.version] = {k: v.clone()
                                        for k, v in run.trainer.model.state_dict().items()}
        return out
    run.sync.push = push_and_remember
    trained = []
    update = run.trainer.update
    run.trainer.update = lambda groups, dropped=(): (trained.append(groups),
                                                     update(groups, dropped))[1]
    return weights, trained


@pytest.mark.integration
def test_rollouts_span_updates_and_keep_each_tokens_version_and_logprob(tmp_path):
    cfg = load_config(None, SMALL + ASYNC + ["loop.max_staleness=1", f"run.root={tmp_path}",
                                             "train.steps=4"])
    run = _slow_pipeline_run(cfg)
    emitted = {}  # request id (the sample's uid) -> (tokens, logprobs, versions) as emitted
    inner_step = run.engine.step

    def recording_step():
        events = inner_step()
        for ev in events:
            t, lp, v = emitted.setdefault(ev.request_id, ([], [], []))
            t += ev.token_ids
            lp += ev.logprobs
            v += ev.versions
        return events
    run.engine.step = recording_step
    weights, trained = _record_versions_and_batches(run)
    pipeline = Pipeline(run, 1, 60)
    results = list(pipeline.steps(1, 4))
    assert [r.version for r in results] == [1, 2, 3, 4]
    samples = [s for groups in trained for g in groups for s in g.samples]
    spanning = [s for s in samples if len(set(s.versions)) > 1]
    assert spanning, "no rollout continued across a weight update"
    stale = [s for groups, k in zip(trained, range(4)) for g in groups for s in g.samples
             if min(s.versions) < k]
    assert stale, "no group was trained at staleness 1"
    for s in samples:  # exactly what the engine emitted, token for token
        t, lp, v = emitted[s.uid]
        assert (s.response_ids, s.logprobs, s.versions) == (t, lp, v)
    # behaviour log-probabilities of one-version rollouts: that version's full forward pass
    model = run.trainer.model
    checked = 0
    for s in samples:
        if len(set(s.versions)) == 1 and s.response_ids:
            model.load_state_dict(weights[s.versions[0]])
            with torch.no_grad():
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                logp = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float().log_softmax(-1)
            ref = logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4)
            checked += 1
    assert checked > 10


def _logprobs_under(model, weights, s) -> torch.Tensor:
    model.load_state_dict(weights)
    with torch.no_grad():
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]


@pytest.mark.integration
def test_recompute_prefills_requests_in_flight_again_after_each_push(tmp_path):
    """loop.carried_kv=recompute: after a push the requests in flight are prefilled again
    under the new weights, so every token of version v has the log-probability of a full
    forward pass of v over the whole context, even in a rollout that spans versions."""
    cfg = load_config(None, SMALL + ASYNC + ["loop.max_staleness=1", f"run.root={tmp_path}",
                                             "train.steps=3", "loop.carried_kv=recompute"])
    run = _slow_pipeline_run(cfg)
    weights, trained = _record_versions_and_batches(run)
    pipeline = Pipeline(run, 1, 60)
    list(pipeline.steps(1, 3))
    assert pipeline.recomputed > 0
    spanning = [s for groups in trained for g in groups for s in g.samples
                if len(set(s.versions)) > 1]
    assert spanning, "no rollout continued across a weight update"
    model = run.trainer.model
    for s in spanning:
        got, versions = torch.tensor(s.logprobs), torch.tensor(s.versions)
        for v in set(s.versions):
            ref = _logprobs_under(model, weights[v], s)
            assert torch.allclose(ref[versions == v], got[versions == v], atol=1e-4)


@pytest.mark.integration
def test_killed_and_resumed_async_runs_lose_and_repeat_nothing(root):
    # staleness 0 after a kill: still the synchronous reference, bit for bit
    run = root / "killed0"
    argv = ["train", *SMALL, *ASYNC, "loop.max_staleness=0", f"run.root={root}",
            "run.name=killed0"]
    assert fork_main(argv, "train:3") == -signal.SIGKILL
    assert fork_main(["train", "--resume", str(run)]) == 0
    assert compare(root / "sync", run) == []
    # staleness 2: the checkpoint of step 4 holds the steps generated ahead of the trainer
    run = root / "killed2"
    argv = ["train", *SMALL, *ASYNC, "loop.max_staleness=2", f"run.root={root}",
            "run.name=killed2", "run.checkpoint_every=4"]
    assert fork_main(argv, "train:5") == -signal.SIGKILL
    assert fork_main(["train", "--resume", str(run)]) == 0
    check_resumed(run, steps=6, eta=2)


# ---- the pipeline's waits, on a stand-in Run ---------------------------------------------------

class _Engine:
    version, tokens_generated = 0, 0

    def step(self):
        return []


def _fake_run(produce):
    run = SimpleNamespace(engine=_Engine(), control=SimpleNamespace(bind=lambda **_: None),
                          current_step=0, cfg=None, sync=SimpleNamespace(push=lambda: {}))
    run.produce = produce
    run.consume = lambda r, push: (push(), r)[1]
    return run


def _result(step):
    return StepResult(step, [], [], Ledger(), 0, 0, seconds={"gen": 0.0})


def test_a_hung_producer_times_out_naming_the_step():
    release = threading.Event()
    run = _fake_run(lambda step: (release.wait(5) if step == 2 else None, _result(step))[1])
    steps = Pipeline(run, 1, 0.5).steps(1, 3)
    assert next(steps).step == 1
    with pytest.raises(TimeoutError, match="rollouts of step 2"):
        next(steps)
    release.set()


def test_a_failing_producer_stops_the_run_with_its_error():
    def produce(step):
        if step == 2:
            raise ValueError("reward function broke")
        return _result(step)
    steps = Pipeline(_fake_run(produce), 1, 5).steps(1, 3)
    assert next(steps).step == 1
    with pytest.raises(RuntimeError, match="generating step 2: reward function broke"):
        next(steps)


def test_admission_holds_the_producer_to_the_bound():
    started = []
    run = _fake_run(lambda step: (started.append(step), _result(step))[1])
    pipeline = Pipeline(run, 2, 5)
    steps = pipeline.steps(1, 8)
    next(steps)  # step 1 trained, not yet finished: steps up to 1 + 2 may start
    time.sleep(0.2)
    assert started == [1, 2, 3]
    next(steps)  # step 1 finished
    time.sleep(0.2)
    assert started == [1, 2, 3, 4]
    steps.close()


class _Recorder:
    def __init__(self, order):
        self.order = order

    def step(self):
        self.order.append("step")


def test_the_gate_lets_a_push_in_between_engine_calls_only():
    gate, order = WeightGate(), []
    engine = GatedEngine(_Recorder(order), gate)

    def push():
        with gate.exclusive():
            order.append("push")
    with gate.shared():  # the producer inside an engine step and its events
        pusher = threading.Thread(target=push)
        pusher.start()
        time.sleep(0.1)
        engine.step()  # re-entrant for the holder
        order.append("events")
    pusher.join(2)
    engine.step()
    assert order == ["step", "events", "push", "step"]


def test_async_on_cpu_splits_the_cores_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(loop_run.os, "cpu_count", lambda: 8)

    def threads(*overrides, device="cpu"):
        return loop_run.torch_threads(load_config(None, list(overrides)), device)
    assert threads("loop.mode=async", "loop.max_staleness=1") == 4  # half each side
    assert threads("loop.mode=async", "loop.max_staleness=2", "sync.transport=process") == 4
    assert threads("loop.mode=async", "loop.max_staleness=1", "run.threads=3") == 3  # asked
    assert threads() == 0  # synchronous: torch's own
    assert threads("loop.mode=async", "loop.max_staleness=0") == 0  # nothing overlaps
    assert threads("loop.mode=async", "loop.max_staleness=1", "loop.backend=ray") == 0
    monkeypatch.setattr(loop_run.os, "cpu_count", lambda: 1)
    assert threads("loop.mode=async", "loop.max_staleness=1") == 1


def test_an_async_run_takes_its_share_of_the_cores_and_gives_them_back(tmp_path, monkeypatch):
    monkeypatch.setattr(loop_run.os, "cpu_count", lambda: 4)
    seen, logged = [], io.StringIO()
    real = loop_run.Run.consume
    monkeypatch.setattr(loop_run.Run, "consume",
                        lambda self, r, push=None: (seen.append(torch.get_num_threads()),
                                                    real(self, r, push))[1])
    before = torch.get_num_threads()
    train(load_config(None, SMALL + ASYNC + ["loop.max_staleness=1", f"run.root={tmp_path}",
                                              "train.steps=2", "run.threads=0"]),
          Progress("plain", 2, stream=logged))
    assert seen == [2, 2] and torch.get_num_threads() == before
    assert "2 torch thread(s) each for generation and training" in logged.getvalue()


@pytest.mark.integration
def test_a_frozen_engine_child_stops_the_run_with_an_error_naming_it(tmp_path, capfd):
    """SIGSTOP on the engine's child process mid-run (asynchronous loop, process transport):
    the run stops within loop.wait_timeout_s with an error naming that process, and the
    child is killed, not left stopped."""
    import multiprocessing
    import os
    frozen = []

    def freeze_the_engine(n):
        if n == 2:
            child, = [p for p in multiprocessing.active_children() if p.name == "rollwise-engine"]
            os.kill(child.pid, signal.SIGSTOP)
            frozen.append(child.pid)
            (tmp_path / "frozen.pid").write_text(str(child.pid))

    argv = ["train", *SMALL, f"run.root={tmp_path}", "run.name=frozen", "loop.mode=async",
            "loop.max_staleness=1", "sync.transport=process", "loop.wait_timeout_s=5",
            "run.log=plain"]
    t0 = time.monotonic()
    code = fork_main(argv, before_step=freeze_the_engine)
    assert code != 0 and time.monotonic() - t0 < 120
    pid = int((tmp_path / "frozen.pid").read_text())
    err = capfd.readouterr().err
    assert f"the engine process (pid {pid}, stopped (SIGSTOP or a debugger)) did not " in err
    assert "it was killed" in err
    assert "leaked shared_memory" not in err
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
        os.kill(pid, 0)
