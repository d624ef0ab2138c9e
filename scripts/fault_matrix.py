"""Faults injected from outside into runs in fresh processes, for every loop mode:

    python3 scripts/fault_matrix.py [--root DIR] [--modes sync async ...] [--json FILE]

Each run is `python -m rollwise train` on a small config (6 steps, checkpoints every 2). A
fault is sent once the run's metrics show step 2: SIGKILL to the driver (then `--resume`),
SIGTERM to the driver (then `--resume`), SIGSTOP to one of the run's other processes (the
engine child, a trainer rank, a Ray worker), or a reward function that hangs on some samples
from the start. Outcomes: `resumed exactly` (the resumed run equals an uninterrupted one:
every metric but timings, every stored rollout, the final weights), `finished` (the run went
on and ended), `stopped: <error>` (it stopped with an error naming the fault, within the
bound), or what went wrong. Every wait here is bounded (--limit seconds a run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from rollwise.bench.crash import compare  # noqa: E402
from tests.loop_helpers import SMALL  # noqa: E402

# the tests' small run (6 steps, checkpoints every 2, a parity reward), logged, with a short bound
RUN = [*SMALL, "run.log=plain", "run.keep_checkpoints=3", "loop.wait_timeout_s=20"]
MODES = {
    "sync": [],
    "async": ["loop.mode=async", "loop.max_staleness=1", "train.correction.mode=tis"],
    "async+process": ["loop.mode=async", "loop.max_staleness=1", "train.correction.mode=tis",
                      "sync.transport=process"],
    "ray": ["loop.backend=ray", "loop.rollout_workers=2"],
    "fsdp2": ["train.world_size=2", "train.minibatches=2", "train.micro_batch_size=5"],
}
# the process SIGSTOP freezes in each mode: a pattern of its command line
CHILD = {"async+process": "rollwise-engine", "ray": "RolloutWorker",
         "fsdp2": "rollwise-trainer-1"}


def start(root: Path, name: str, mode: str, extra=()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rollwise", "train", *RUN, *MODES[mode],
            f"run.root={root}", f"run.name={name}", *extra]
    log = open(root / f"{name}.log", "ab")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ | {"RAY_AUTH_MODE": "disabled"})


def resume(root: Path, name: str, limit: float) -> int:
    with open(root / f"{name}.log", "ab") as log:
        return subprocess.run([sys.executable, "-m", "rollwise", "train", "--resume",
                               str(root / name)], stdout=log, stderr=subprocess.STDOUT,
                              timeout=limit).returncode


def wait_for_step(root: Path, name: str, proc: subprocess.Popen, step: int, limit: float
                  ) -> bool:
    metrics, t0 = root / name / "metrics.jsonl", time.monotonic()
    while time.monotonic() - t0 < limit and proc.poll() is None:
        if metrics.exists() and any(json.loads(line).get("step", -1) >= step
                                    for line in metrics.read_text().splitlines() if line):
            return True
        time.sleep(0.2)
    return False


def finish(proc: subprocess.Popen, limit: float) -> int | None:
    try:
        return proc.wait(limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def processes_matching(pattern: str) -> list[int]:
    """pids whose command line or name holds `pattern` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = (d / "comm").read_text()
        except OSError:
            continue
        if pattern in cmd or pattern in comm:
            out.append(int(d.name))
    return out


def last_error(root: Path, name: str) -> str:
    lines = (root / f"{name}.log").read_text(errors="replace").splitlines()
    errors = [line for line in lines if "Error" in line or line.startswith("rollwise:")]
    return (errors or lines or ["(no output)"])[-1][:160]


def kill_and_resume(root: Path, mode: str, sig: signal.Signals, limit: float) -> str:
    name = f"{mode}-{sig.name}"
    proc = start(root, name, mode)
    if not wait_for_step(root, name, proc, 2, limit):
        finish(proc, 1)
        return f"never reached step 2: {last_error(root, name)}"
    os.kill(proc.pid, sig)
    code = finish(proc, limit)
    if code is None:
        return f"did not end within {limit:.0f}s of {sig.name}"
    if sig == signal.SIGTERM and code != 128 + sig:
        return f"exit {code} after SIGTERM (expected 143): {last_error(root, name)}"
    rc = resume(root, name, limit)
    if rc != 0:
        return f"resume failed (exit {rc}): {last_error(root, name)}"
    diffs = compare(root / f"{mode}-reference", root / name)
    exit_note = f"exit {code}, " if sig == signal.SIGTERM else ""
    return f"{exit_note}resumed exactly" if not diffs else f"resumed with {diffs[:2]}"


def stop_a_child(root: Path, mode: str, limit: float) -> str:
    name = f"{mode}-SIGSTOP-child"
    proc = start(root, name, mode)
    if not wait_for_step(root, name, proc, 2, limit):
        finish(proc, 1)
        return f"never reached step 2: {last_error(root, name)}"
    mine = [p for p in processes_matching(CHILD[mode]) if p != proc.pid]
    if not mine:
        finish(proc, 1)
        return f"no process matching {CHILD[mode]!r} to stop"
    os.kill(mine[0], signal.SIGSTOP)
    t0 = time.monotonic()
    code = finish(proc, limit)
    took = time.monotonic() - t0
    for pid in mine:  # never leave one stopped
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code is None:
        return f"hung: no end within {limit:.0f}s"
    if code == 0:
        return f"finished ({took:.0f}s after the stop)"
    return f"stopped in {took:.0f}s: {last_error(root, name)}"


def hanging_reward(root: Path, mode: str, limit: float) -> str:
    name = f"{mode}-hanging-reward"
    proc = start(root, name, mode, ["filter.reward=tests.loop_helpers:hangs_sometimes",
                                    "filter.timeout_s=2"])
    code = finish(proc, limit)
    if code is None:
        return f"hung: no end within {limit:.0f}s"
    return "finished" if code == 0 else f"stopped (exit {code}): {last_error(root, name)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/fault-matrix")
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--limit", type=float, default=300.0, help="seconds any run may take")
    ap.add_argument("--json", help="write the matrix here too")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    matrix: dict[str, dict[str, str]] = {}
    for mode in args.modes:
        ref = start(root, f"{mode}-reference", mode)
        if finish(ref, args.limit) != 0:
            matrix[mode] = {"reference": f"failed: {last_error(root, f'{mode}-reference')}"}
            continue
        row = {"SIGKILL driver": kill_and_resume(root, mode, signal.SIGKILL, args.limit),
               "SIGTERM driver": kill_and_resume(root, mode, signal.SIGTERM, args.limit)}
        if mode in CHILD:
            row[f"SIGSTOP {CHILD[mode]}"] = stop_a_child(root, mode, args.limit)
        row["reward hangs"] = hanging_reward(root, mode, args.limit)
        matrix[mode] = row
        print(json.dumps({mode: row}), flush=True)
    faults = list(dict.fromkeys(f for row in matrix.values() for f in row))
    print("| mode | " + " | ".join(faults) + " |")
    print("|---" * (len(faults) + 1) + "|")
    for mode, row in matrix.items():
        print(f"| {mode} | " + " | ".join(row.get(f, "n/a") for f in faults) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(matrix, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
