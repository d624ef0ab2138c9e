"""Crash test at full size: train, SIGKILL the process at random points, resume, and compare
with an uninterrupted run of the same seed.

    rollwise bench crash --kills 12 [key=value ...]      # the default run (60 steps)

Each attempt runs `python -m rollwise train` (a fresh interpreter, as a user's resume is) and
kills it either at a named point of a random step (ROLLWISE_KILL_AT: during generation, the
store's write-ahead log, the Parquet write, the optimizer update, a checkpoint write) or after a
random delay (wherever it happens to be). It then resumes with `rollwise train --resume RUN`,
killing again until the kills are used up, and lets the last resume finish. Checked against the
reference run: every metric but timings equal at every step (bit for bit), every rollout in the
store exactly once with equal content, the final weights equal, every checkpoint intact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from rollwise.config import load_config
from rollwise.report.data import read_metrics
from rollwise.store import checkpoint as ckpt
from rollwise.store.killpoint import ENV, PHASES
from rollwise.store.rollouts import RolloutStore


def is_measured(key: str) -> bool:
    """A figure of the machine (time, resident memory), not of the run's content."""
    return key.startswith(("perf/", "memory/")) or key.endswith("seconds")


def metric_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_measured(k)}
            for r in read_metrics(run_dir / "metrics.jsonl")]


def store_rows(run_dir: Path) -> list[dict]:
    """Rollouts without their random uid and wall-clock timings, in a canonical order."""
    rows = RolloutStore(run_dir / "rollouts").read().to_pylist()
    for r in rows:
        for k in ("uid", "parent_uid", "timings"):
            r.pop(k)
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def weights(run_dir: Path) -> dict:
    """The final model's tensors (a LoRA run's: its adapter's)."""
    folder = run_dir / "model"
    adapter = folder / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else folder / "model.safetensors")


def compare(ref: Path, run: Path) -> list[str]:
    """Every difference between the resumed run and the reference (empty: identical)."""
    ref, run, problems = Path(ref), Path(run), []
    a, b = metric_rows(ref), metric_rows(run)
    if [r["step"] for r in a] != [r["step"] for r in b]:
        problems.append(f"metric steps {[r['step'] for r in b]} != {[r['step'] for r in a]}")
    for x, y in zip(a, b):
        diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if diff:
            problems.append(f"step {x['step']}: {len(diff)} metrics differ, e.g. {diff[:4]}")
    uids = RolloutStore(run / "rollouts").read().column("uid").to_pylist()
    if len(uids) != len(set(uids)):
        problems.append(f"{len(uids) - len(set(uids))} rollouts stored more than once")
    if store_rows(ref) != store_rows(run):
        problems.append("the rollout store differs from the reference's")
    wa, wb = weights(ref), weights(run)
    if wa.keys() != wb.keys() or any(not wa[k].equal(wb[k]) for k in wa):
        problems.append("final weights differ")
    for c in ckpt.listing(run):
        if (why := ckpt.problem(c.path)) is not None:
            problems.append(f"checkpoint {c.path.name} damaged: {why}")
    if list((run / "checkpoints").glob(".tmp-*")):
        problems.append("a partial checkpoint folder was left behind")
    return problems


def child(argv: list[str], kill_at: str | None = None, kill_after: float | None = None,
          log=None) -> int:
    """Run `python -m rollwise` with argv; returns its exit code (-9: killed). The child leads
    its own process group, killed once it has ended: what a killed driver leaves behind (the
    local Ray's agents of loop.backend=ray, spawned ranks) does not outlive it."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if kill_at:
        env[ENV] = kill_at
    out = open(log, "a") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "rollwise", *argv], env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        return proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def next_kill(rng: random.Random, i: int, run: Path, steps: int,
              every: int) -> tuple[str | None, float | None]:
    """The i-th kill point: every third a random delay, else the next phase in turn (so each
    one is tried) at a random step after the newest checkpoint (so the run reaches it); a
    checkpoint kill picks a step that writes one (every `every` steps, and the last)."""
    if i % 3 == 2:
        return None, rng.uniform(5.0, 60.0)
    phase = PHASES[(i - i // 3) % len(PHASES)]
    last = ckpt.latest(run, log=lambda _: None)
    first = last.step + 1 if last is not None and last.step < steps else 1
    candidates = range(first, steps + 1)
    if phase == "checkpoint":
        candidates = [s for s in candidates if (every and s % every == 0) or s == steps]
    return f"{phase}:{rng.choice(candidates)}", None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench crash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan")
    p.add_argument("--root", default="runs/bench-crash")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    base = [*args.overrides, f"run.root={root}", "run.log=plain", "run.report=false"]
    cfg = load_config(None, base)
    steps, every = cfg.train.steps, cfg.run.checkpoint_every
    t0 = time.time()
    rc = child(["train", *base, "run.name=reference"], log=root / "reference.log")
    if rc != 0:
        print(f"the reference run failed (exit {rc}); see {root / 'reference.log'}")
        return 1
    ref_seconds = time.time() - t0
    run, log = root / "crashed", root / "crashed.log"
    rng, attempts, fresh = random.Random(args.seed), [], True
    for i in range(args.kills):
        at, after = next_kill(rng, i, run, steps, every)
        argv = ["train", *base, "run.name=crashed"] if fresh else ["train", "--resume",
                                                                   str(run), "run.log=plain"]
        rc = child(argv, at, after, log)
        attempts.append({"kill_at": at, "kill_after_s": after, "exit": rc})
        fresh = rc == 0  # finished before the kill came: the next attempt starts over
    final = child(["train", "--resume", str(run), "run.log=plain"], log=log)
    problems = compare(root / "reference", run) if final == 0 else [f"final resume exit {final}"]
    killed = sum(a["exit"] == -signal.SIGKILL for a in attempts)
    result = {"kill_points_tried": len(attempts), "killed": killed, "steps": steps,
              "identical": not problems, "problems": problems, "attempts": attempts,
              "reference_seconds": ref_seconds, "total_seconds": time.time() - t0}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("| kill point | exit |\n|---|---|")
        for a in attempts:
            what = a["kill_at"] or f"after {a['kill_after_s']:.1f} s"
            print(f"| {what} | {a['exit']} |")
        print(f"\n{len(attempts)} kill points tried ({killed} killed the process, "
              f"{steps} steps); resumed run identical to the reference: {not problems}")
        for line in problems:
            print("  " + line)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
