"""Peak resident memory of each phase of a config's run, as the kernel counts it.

    rollwise bench memory --config smollm2 --steps 3 --json memory.json [KEY=VALUE ...]

Runs `rollwise train` on the config in a fresh process (its peak is the run's own) for
--steps steps, with held-out evaluations at step 0 and at the last step, and prints each
phase's peak from the run's metrics (memory/phase/*: loading, warm start, evaluation,
generation, scoring, update, sync), the step it was reached at, and the process's peak twice:
from the metrics (their last row) and the kernel's high-water mark at the run's end, after its
final checkpoint and save (summary.json). wait4's maxrss of the child is not used: it counts
the parent's resident pages the child shared before it exec'd.
KEY=VALUE arguments are passed to the run (a lever on or off, a smaller evaluation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="rollwise bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a config file or preset (none: the default)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--root", default="runs/bench-memory", help="where the run is written")
    p.add_argument("--name", default=None, help="the run's name (default: the config's + -memory)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to the run")
    args = p.parse_args(argv)
    overrides = args.overrides
    bad = [o for o in overrides if "=" not in o]
    if bad:
        p.error(f"not an option or KEY=VALUE override: {' '.join(bad)}")
    owned = {"run.root": "--root", "run.name": "--name", "train.steps": "--steps",
             "run.eval_every": "--steps"}  # keys the command sets itself, after the overrides
    taken = [f"{o} (use {owned[o.split('=')[0]]})" for o in overrides if o.split("=")[0] in owned]
    if taken:
        p.error(f"set by this command's own options: {', '.join(taken)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args, overrides


def run_command(args, overrides: list[str], name: str) -> list[str]:
    config = ["--config", args.config] if args.config else []
    return [sys.executable, "-m", "rollwise", "train", *config, *overrides,
            f"train.steps={args.steps}", f"run.eval_every={args.steps}", f"run.root={args.root}",
            f"run.name={name}", "run.log=plain", "run.report=false", "run.tensorboard=false"]


def run_child(cmd: list[str], log: Path) -> tuple[int, float]:
    """(exit status, seconds)."""
    t = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode, time.time() - t


def phase_peaks(rows: list[dict]) -> dict[str, dict]:
    """{phase: {"peak_gib", "step"}}, the largest over the run, in the order first seen."""
    out: dict[str, dict] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("memory/phase/"):
                name = key.removeprefix("memory/phase/").removesuffix("_peak_gib")
                if name not in out or value > out[name]["peak_gib"]:
                    out[name] = {"peak_gib": value, "step": row.get("step")}
    return out


def render(result: dict) -> str:
    lines = [f"{'phase':<14}{'peak GiB':>10}  at step"]
    for name, p in result["phases"].items():
        lines.append(f"{name:<14}{p['peak_gib']:>10.2f}  {p['step']}")
    lines.append(f"{'whole process':<14}{result['peak_gib']:>10.2f}  (metrics); "
                 f"{result['kernel_peak_gib']:.2f} (the kernel, at the end)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    name = args.name or f"{Path(args.config or 'default').stem}-memory"
    run_dir = Path(args.root) / name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.root) / f"{name}.log"
    cmd = run_command(args, overrides, name)
    print(f"running {' '.join(cmd[1:])}  (log: {log})", flush=True)
    code, seconds = run_child(cmd, log)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print("the run failed (exit %d); the end of its log:\n%s" % (code, "\n".join(tail)),
              file=sys.stderr)
        return 1
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    result = {"config": args.config, "overrides": overrides, "steps": args.steps,
              "phases": phase_peaks(rows),
              "peak_gib": max(r.get("memory/peak_gib", 0.0) for r in rows),
              "kernel_peak_gib": json.loads((run_dir / "summary.json").read_text())[
                  "memory_peak_gib"], "seconds": seconds, "log": str(log)}
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
