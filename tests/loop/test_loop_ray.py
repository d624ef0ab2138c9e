"""loop.backend=ray (rollwise/engine/ray_pool.py): rollout workers as Ray actors. One worker at seed
0 is the in-process engine bit for bit; workers killed with SIGKILL (or frozen past the timeout)
at random points lose no rollout and repeat none, and the metrics count the re-queued requests;
workers join and leave mid-run; weights reach every worker through one object-store put."""

import contextlib
import os
import random
import signal

import pytest

ray = pytest.importorskip("ray")

from loop_helpers import SMALL, _check_store  # noqa: E402

from rollwise.bench.crash import metric_rows, store_rows, weights  # noqa: E402
from rollwise.config import load_config  # noqa: E402
from rollwise.loop.metrics import step_metrics  # noqa: E402
from rollwise.loop.run import Run, train  # noqa: E402
from rollwise.report.progress import Progress  # noqa: E402
from rollwise.sync.payload import from_wire as _unwire  # noqa: E402

pytestmark = pytest.mark.integration  # whole training loops

RAY = ["loop.backend=ray"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_one_worker_is_the_in_process_engine_bit_for_bit(tmp_path):
    common = SMALL + [f"run.root={tmp_path}", "train.steps=3"]
    train(load_config(None, common + ["run.name=local"]))
    train(load_config(None, common + RAY + ["loop.rollout_workers=1", "run.name=ray"]))
    a, b = tmp_path / "local", tmp_path / "ray"
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("workers/")}  # noqa
                         for r in rows]
    assert drop(metric_rows(a)) == drop(metric_rows(b))
    assert store_rows(a) == store_rows(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def _run(tmp_path, extra=()):
    cfg = load_config(None, SMALL + RAY + [f"run.root={tmp_path}", "train.steps=4",
                                           "sync.mode=sparse", *extra])
    return Run(cfg, Progress("quiet", cfg.train.steps)), cfg


def test_workers_killed_at_random_points_lose_and_repeat_no_rollout(tmp_path):
    run, cfg = _run(tmp_path, ["loop.rollout_workers=2"])
    pool, rng = run.engine, random.Random(0)
    step_calls = {"n": 0}
    kill_at = set(rng.sample(range(2, 40), 4))
    inner = pool.step

    def step_with_kills():
        step_calls["n"] += 1
        if step_calls["n"] in kill_at:
            key = rng.choice(sorted(pool.workers))
            os.kill(pool.pids()[key], signal.SIGKILL)
        return inner()
    pool.step = step_with_kills
    metrics = [step_metrics(run.step(s)) for s in range(1, 5)]
    assert pool.counts["worker_deaths"] >= 1
    assert sum(m["workers/requeued"] for m in metrics[-1:]) == pool.counts["requeued"] > 0
    assert len(pool.workers) == 2  # each dead worker was replaced
    _check_store(run, cfg, 4)
    # every worker holds the trainer's weights after the last sync, bit for bit
    run.sync.compare()


def test_a_frozen_worker_times_out_and_its_requests_go_elsewhere(tmp_path):
    # the bound must clear a healthy worker's step on a loaded 2-core machine (at 3 s the
    # live worker timed out too beside the rest of the suite), or both count as deaths
    run, cfg = _run(tmp_path, ["loop.rollout_workers=2", "loop.wait_timeout_s=10"])
    pool = run.engine
    run.step(1)
    frozen = pool.pids()[0]
    os.kill(frozen, signal.SIGSTOP)
    try:
        run.step(2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the pool has killed it already
            os.kill(frozen, signal.SIGKILL)
    assert pool.counts["worker_deaths"] == 1 and 0 not in pool.workers
    _check_store(run, cfg, 2)


def test_workers_join_and_leave_mid_run(tmp_path):
    run, cfg = _run(tmp_path, ["loop.rollout_workers=2"])
    pool = run.engine
    pool.max_chain = 1  # the second sparse payload folds the kept ones into one full payload
    run.step(1)
    run.step(2)
    assert len(pool.chain) == 1
    new = pool.join()  # replays the kept payload
    run.step(3)
    theirs = ray.get(pool.workers[new].weights.remote())
    ours = run.trainer.weights()
    assert all(_unwire(theirs[k]).equal(ours[k].to(_unwire(theirs[k]).dtype)) for k in theirs)
    pool.leave(0)
    pool.leave(new)
    run.step(4)
    assert sorted(pool.workers) == [1]
    assert pool.counts == {"worker_deaths": 0, "requeued": 0, "joined": 3, "left": 2}
    _check_store(run, cfg, 4)
    run.sync.compare()


def test_trainer_ranks_as_ray_actors_give_one_ranks_update(tmp_path):
    """train.world_size=2 with loop.backend=ray: the FSDP2 ranks are Ray actors."""
    import copy

    from loop_helpers import SHARDED

    from rollwise.training.ray_ranks import RayRanks
    from rollwise.training.sharded import ShardedTrainer
    from rollwise.training.trainer import Trainer
    cfg = load_config(None, SMALL + SHARDED + [f"run.root={tmp_path}"])
    run = Run(cfg, Progress("quiet", 2))
    r = run.produce(1)
    start = copy.deepcopy(run.trainer.model)
    one = Trainer(copy.deepcopy(start), cfg.train, pad_id=run.tokenizer.pad_token_id)
    two = ShardedTrainer(copy.deepcopy(start), cfg.train, pad_id=run.tokenizer.pad_token_id,
                         world_size=2, timeout_s=120, ranks=RayRanks)
    try:
        for _ in range(2):
            a, b = one.update(r.trained, r.dropped), two.update(r.trained, r.dropped)
            wa, wb = one.weights(), two.weights()
            assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
    finally:
        two.close()


def test_the_loop_on_ray_with_rollout_workers_and_trainer_ranks(tmp_path):
    from loop_helpers import SHARDED
    summary = train(load_config(None, SMALL + SHARDED + RAY + [
        f"run.root={tmp_path}", "train.steps=2", "train.world_size=2", "loop.mode=async",
        "train.correction.mode=tis"]))
    assert summary["steps"] == 2 and summary["tokens_trained"] > 0


def test_a_replacement_that_dies_while_starting_is_replaced_in_turn(tmp_path):
    """Kill a worker, then its replacement while it starts: a third takes over, the step
    finishes, both deaths are counted and no rollout is lost or repeated."""
    run, cfg = _run(tmp_path, ["loop.rollout_workers=1"])
    with run:
        pool, spawn, killed = run.engine, run.engine._spawn, []

        def spawn_then_kill_the_first():
            key, actor = spawn()
            if not killed:
                ray.kill(actor)  # dies before it reports that it started
                killed.append(key)
            return key, actor
        pool._spawn = spawn_then_kill_the_first
        os.kill(next(iter(pool.pids().values())), signal.SIGKILL)
        m = step_metrics(run.step(1))
        assert killed and m["workers/worker_deaths"] == 2 and m["workers/live"] == 1
        _check_store(run, cfg, 1)


def test_lora_workers_apply_adapters_and_one_that_joins_later_gets_base_and_adapters(tmp_path):
    import copy

    from rollwise.engine import BuiltinEngine, Request, SamplingParams
    run, cfg = _run(tmp_path, ["loop.rollout_workers=1", "train.lora.rank=4",
                               "train.lora.targets=all-linear", "train.lr=1e-2",
                               "sync.check=true"])
    with run:
        pool = run.engine
        for s in (1, 2):
            run.step(s)  # sync.check: the worker's adapters are the trainer's, bit for bit
        first = next(iter(pool.workers))
        pool.join()  # replays the base weights, takes the adapters, replays their payloads
        pool.leave(first)
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        reqs = [Request(run.tokenizer(p)["input_ids"], params, i)
                for i, p in enumerate(["12+34=", "7-5=", "55-12="])]
        merged = copy.deepcopy(run.trainer.model).merge_and_unload()
        expected = BuiltinEngine(merged).generate(reqs)
        base = BuiltinEngine(copy.deepcopy(run.trainer.model).unload()).generate(reqs)
        got = pool.generate(reqs)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        for g, e in zip(got, expected):
            assert max(abs(x - y) for x, y in zip(g.logprobs, e.logprobs)) < 1e-5
        assert [c.logprobs for c in got] != [c.logprobs for c in base]  # the adapters count
        run.sync.compare()
