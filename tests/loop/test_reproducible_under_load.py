"""Two runs with the same seed at default settings (run.threads unset: every core), each in a
fresh process, beside processes that keep every core busy, are bit-identical: the trainer's
weights and optimizer state after each step, and every stored rollout. Without MKL's strict
reproducible mode they differed from the first update (rollwise.numerics)."""

import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

STEPS = 2
LOAD_S = 30
RUN = ["task.eval_size=16", "sft.steps=0", f"train.steps={STEPS}", "run.eval_every=100",
       "run.checkpoint_every=1", f"run.keep_checkpoints={STEPS}"]


def train(root, name: str, env=None) -> None:
    out = subprocess.run([sys.executable, "-m", "rollwise", "train", f"run.root={root}",
                          f"run.name={name}", *RUN], capture_output=True, text=True,
                         timeout=900, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]


def tensors(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in
                tensors(value, f"{prefix}{key}/").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in
                tensors(value, f"{prefix}{i}/").items()}
    return {prefix: obj} if torch.is_tensor(obj) else {}


def differences(a, b) -> list[str]:
    """What differs between two runs: trainer tensors per step, rollout columns per step."""
    out = []
    for step in range(1, STEPS + 1):
        state = [tensors(torch.load(r / f"checkpoints/step-{step:06d}/state.pt",
                                    weights_only=False)["trainer"]) for r in (a, b)]
        out += [f"step {step}: {k}" for k in state[0] if not torch.equal(state[0][k],
                                                                          state[1][k])]
        rows = [pq.read_table(r / f"rollouts/step-{step:06d}.parquet").drop_columns(
            ["timings"]).to_pylist() for r in (a, b)]
        out += [f"step {step}: rollout {k}" for k in rows[0][0]
                if [x[k] for x in rows[0]] != [x[k] for x in rows[1]] and k != "uid"]
    return out


def two_runs_beside_a_hog(root, env=None) -> list[str]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(LOAD_S)  # the load builds before the runs start
        for name in ("a", "b"):
            train(root, name, env)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return differences(root / "a", root / "b")


@pytest.mark.integration  # two short runs beside a CPU hog: about 2 minutes on 2 cores
def test_same_seed_runs_beside_a_cpu_hog_are_bit_identical(tmp_path):
    assert two_runs_beside_a_hog(tmp_path) == []
