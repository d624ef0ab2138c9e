"""Faults injected from outside into runs in fresh processes, for every loop mode:

    python3 scripts/fault_matrix.py [--root DIR] [--modes sync async ...] [--faults ...]

Each run is `python -m rollwise train` on a small config (12 steps, checkpoints every 2: long
enough that a signal at step 2 never meets the last step). A fault comes once the run's
metrics show step 2: SIGKILL to the driver (then `--resume`),
SIGTERM to the driver (then `--resume`), SIGSTOP to one of the run's other processes (the
engine child, a trainer rank, a Ray worker); or from the start: a disk that fills (a 640 KiB
tmpfs, then grown and the run resumed), a reward function that hangs on some samples.
Outcomes: `resumed exactly` (the resumed run equals an uninterrupted one: every metric but
timings, every stored rollout, the final weights), `finished` (the run went on and ended),
`stopped: <error>` (it stopped with an error naming the fault, within the bound), or what
went wrong. Every wait here is bounded (--limit seconds a run).
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
from rollwise.report.data import read_metrics  # noqa: E402
from rollwise.store.rollouts import RolloutStore  # noqa: E402
from tests.loop_helpers import SMALL  # noqa: E402

# the tests' small run (checkpoints every 2, a parity reward) at 12 steps, logged, short bound
RUN = [*SMALL, "train.steps=12", "run.log=plain", "run.keep_checkpoints=3",
       "loop.wait_timeout_s=20"]
ETA = 1  # loop.max_staleness of the asynchronous modes
ASYNC = ["loop.mode=async", f"loop.max_staleness={ETA}", "train.correction.mode=tis"]
MODES = {
    "sync": [],
    "async": ASYNC,
    "async+process": [*ASYNC, "sync.transport=process"],
    "ray": ["loop.backend=ray", "loop.rollout_workers=2"],
    "fsdp2": ["train.world_size=2", "train.minibatches=2", "train.micro_batch_size=5"],
}
# the process SIGSTOP freezes in each mode
CHILD = {"async+process": "the engine child", "ray": "a Ray rollout worker",
         "fsdp2": "trainer rank 1"}


def start(root: Path, name: str, mode: str, extra=(), logs: Path | None = None
          ) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rollwise", "train", *RUN, *MODES[mode],
            f"run.root={root}", f"run.name={name}", *extra]
    log = open((logs or root) / f"{name}.log", "ab")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ | {"RAY_AUTH_MODE": "disabled"})


def resume(root: Path, name: str, limit: float, logs: Path | None = None) -> int:
    with open((logs or root) / f"{name}.log", "ab") as log:
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


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d.name)] = (ppid, cmd)
    return out


def the_child(mode: str, driver: int) -> int | None:
    """The process of the run that CHILD[mode] names: a Ray worker by its title; the engine
    child or trainer rank 1 as the driver's spawned children (rank 1: the later of two)."""
    procs = processes()
    if mode == "ray":
        return next((p for p, (_, cmd) in procs.items() if "RolloutWorker" in cmd), None)
    spawned = sorted(p for p, (ppid, cmd) in procs.items()
                     if ppid == driver and "spawn_main" in cmd and "resource_tracker" not in cmd)
    return spawned[-1] if spawned else None


def last_error(root: Path, name: str) -> str:
    lines = (root / f"{name}.log").read_text(errors="replace").splitlines()
    errors = [line for line in lines if "Error" in line or line.startswith("rollwise:")]
    return (errors or lines or ["(no output)"])[-1][:160]


def resumed(ref: Path, run: Path, mode: str) -> str:
    """How the resumed run compares with the uninterrupted one. The asynchronous modes push
    weights whenever the trainer is done, so which version samples a token depends on timing:
    there the check is that every step and every rollout is there exactly once, with no token
    staler than loop.max_staleness allows."""
    diffs = compare(ref, run)
    if not diffs:
        return "resumed exactly"
    if not mode.startswith("async"):
        return f"resumed with {diffs[:2]}"
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    stored = RolloutStore(run / "rollouts").read().to_pylist()
    uids = [r["uid"] for r in stored]
    want = len(RolloutStore(ref / "rollouts").read().to_pylist())
    stale = max(r.get("staleness/max", 0) for r in read_metrics(run / "metrics.jsonl"))
    if steps == list(range(len(steps))) and len(uids) == len(set(uids)) == want and stale <= ETA:
        return "resumed, nothing lost or repeated (stale tokens differ: timing)"
    return f"resumed with {diffs[:2]}"


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
    if code == 0 and (root / name / "summary.json").exists():
        return "finished (the signal came during its last step)"
    if sig == signal.SIGTERM and code != 128 + sig:
        return f"exit {code} after SIGTERM (expected 143): {last_error(root, name)}"
    rc = resume(root, name, limit)
    if rc != 0:
        return f"resume failed (exit {rc}): {last_error(root, name)}"
    exit_note = f"exit {code}, " if sig == signal.SIGTERM else ""
    return exit_note + resumed(root / f"{mode}-reference", root / name, mode)


def stop_a_child(root: Path, mode: str, limit: float) -> str:
    name = f"{mode}-SIGSTOP-child"
    proc = start(root, name, mode)
    if not wait_for_step(root, name, proc, 2, limit):
        finish(proc, 1)
        return f"never reached step 2: {last_error(root, name)}"
    child = the_child(mode, proc.pid)
    if child is None:
        finish(proc, 1)
        return f"{CHILD[mode]} not found"
    mine = [child]
    os.kill(child, signal.SIGSTOP)
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


def full_disk(root: Path, mode: str, limit: float) -> str:
    """The run on a 640 KiB tmpfs, which fills mid-run; then the tmpfs grown and the run
    resumed (mounting needs root: skipped, saying so, without it)."""
    disk = root / f"{mode}-disk"
    disk.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        return "skipped: cannot mount a tmpfs here (needs root)"
    name = f"{mode}-disk-run"
    try:
        code = finish(start(disk, name, mode, logs=root), limit)
        if code is None:
            return f"hung: no end within {limit:.0f}s"
        if code == 0:
            return "finished (the disk never filled)"
        said = last_error(root, name)
        if "no space left on the device" not in said:
            return f"stopped (exit {code}) without naming the disk: {said}"
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        if resume(disk, name, limit, logs=root) != 0:
            return f"exit {code} naming the disk; the resume failed: {last_error(root, name)}"
        return f"exit {code} naming the disk, " + resumed(root / f"{mode}-reference",
                                                           disk / name, mode)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def hanging_reward(root: Path, mode: str, limit: float) -> str:
    name = f"{mode}-hanging-reward"
    proc = start(root, name, mode, ["filter.reward=tests.filter_userfns:hangs_sometimes",
                                    "filter.workers=1", "filter.timeout_s=2"])
    code = finish(proc, limit)
    if code is None:
        return f"hung: no end within {limit:.0f}s"
    return "finished" if code == 0 else f"stopped (exit {code}): {last_error(root, name)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/fault-matrix")
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--faults", nargs="*", default=["kill", "term", "stop", "disk", "hang"],
                    help="kill (SIGKILL), term (SIGTERM), stop (SIGSTOP a child), disk (a full "
                         "tmpfs), hang (a reward that hangs)")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds any run may take")
    ap.add_argument("--json", help="write the matrix here too")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    matrix: dict[str, dict[str, str]] = {}
    for mode in args.modes:
        if {"kill", "term", "disk"} & set(args.faults):  # the run a resume must equal
            if finish(start(root, f"{mode}-reference", mode), args.limit) != 0:
                matrix[mode] = {"reference": f"failed: {last_error(root, f'{mode}-reference')}"}
                continue
        row = {}
        if "kill" in args.faults:
            row["SIGKILL driver"] = kill_and_resume(root, mode, signal.SIGKILL, args.limit)
        if "term" in args.faults:
            row["SIGTERM driver"] = kill_and_resume(root, mode, signal.SIGTERM, args.limit)
        if "stop" in args.faults and mode in CHILD:
            row[f"SIGSTOP {CHILD[mode]}"] = stop_a_child(root, mode, args.limit)
        if "disk" in args.faults:
            row["disk fills"] = full_disk(root, mode, args.limit)
        if "hang" in args.faults:
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
