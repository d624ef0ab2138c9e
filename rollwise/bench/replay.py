"""Rollout replay at a share of each batch vs none: generated tokens to reach a held-out
pass@1 target on the default task.

    rollwise bench replay --seeds 0 1 2 --share 0.5 --target 0.9 [key=value ...]

Both arms start from the same warm start (trained once, run.seed 0), use the same config and
seeds and differ only in replay.enabled / replay.share. Held-out greedy pass@1 is evaluated
every run.eval_every steps (5 here); tokens to target are the generated tokens (tokens/generated,
summed) up to the first evaluation at or above the target ("not reached": infinite). Reported
per arm as medians over the seeds, with steps to target, training seconds to target (evaluation
excluded), and final and best pass@1.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from rollwise.bench.target import reaches
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.report.data import read_metrics
from rollwise.tasks import load_task
from rollwise.training.sft import warm_start, warm_start_path

DEFAULTS = ["run.eval_every=5", "run.log=quiet", "run.report=false", "run.tensorboard=false",
            "train.correction.mode=tis"]


def to_target(rows: list[dict], target: float) -> dict:
    """Generated tokens, steps and training seconds up to the first eval >= target."""
    tokens = seconds = 0.0
    for r in rows:
        tokens += float(r.get("tokens/generated", 0))
        seconds += float(r.get("perf/step_seconds", 0))
        if reaches(r.get("eval/pass1", -1.0), target):
            return {"tokens": tokens, "steps": r["step"], "seconds": seconds}
    return {"tokens": math.inf, "steps": None, "seconds": math.inf}


def one_run(overrides: list[str], target: float) -> dict:
    cfg = load_config(None, overrides)
    summary = train(cfg)
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    evals = [r["eval/pass1"] for r in rows if "eval/pass1" in r]
    return {**to_target(rows, target), "final": evals[-1], "best": max(evals),
            "start": evals[0], "tokens_total": summary["tokens_generated"]}


def warm_start_dir(base: list[str], log) -> str:
    cfg = load_config(None, base + ["run.seed=0"])
    task = load_task(cfg.task)
    warm_start(cfg, task, log=log)
    return str(warm_start_path(cfg, task))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--share", type=float, default=0.5)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--root", default="runs/bench-replay")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    base = [*DEFAULTS, *args.overrides, f"run.root={args.root}"]
    log = (lambda m: print(m, file=sys.stderr)) if not args.json else (lambda m: None)
    init = warm_start_dir(base, log)
    arms = {"replay 0%": ["replay.enabled=false"],
            f"replay {args.share:.0%}": ["replay.enabled=true", f"replay.share={args.share}"]}
    runs = []
    for seed in args.seeds:
        for arm, extra in arms.items():
            name = f"{arm.replace(' ', '').replace('%', 'pct')}-seed{seed}"
            r = one_run(base + extra + [f"run.init={init}", f"run.seed={seed}",
                                        f"run.name={name}"], args.target)
            runs.append({"arm": arm, "seed": seed, **r})
            log(f"{arm} seed {seed}: tokens to {args.target} {r['tokens']:.0f}, steps "
                f"{r['steps']}, final {r['final']:.3f}")
    table = {arm: {k: median([r[k] for r in runs if r["arm"] == arm])
                   for k in ("tokens", "seconds", "final", "best", "start", "tokens_total")}
             for arm in arms}
    for arm in arms:
        table[arm]["steps"] = median([r["steps"] if r["steps"] is not None else math.inf
                                      for r in runs if r["arm"] == arm])
        table[arm]["reached"] = sum(r["steps"] is not None for r in runs if r["arm"] == arm)
    base_arm, replay_arm = list(arms)
    ratio = table[replay_arm]["tokens"] / table[base_arm]["tokens"]
    if args.json:
        print(json.dumps({"target": args.target, "seeds": args.seeds, "table": table,
                          "tokens_ratio": ratio, "runs": runs}, indent=2, default=str))
        return 0
    print(f"pass@1 target {args.target}, seeds {args.seeds}, medians over seeds\n")
    print("| arm | reached | generated tokens to target | steps to target | train s to "
          "target | pass@1 start | final | best |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, t in table.items():
        print(f"| {arm} | {t['reached']}/{len(args.seeds)} | {t['tokens']:.0f} | {t['steps']} | "
              f"{t['seconds']:.0f} | {t['start']:.3f} | {t['final']:.3f} | {t['best']:.3f} |")
    print(f"\ngenerated tokens to target, {replay_arm} / {base_arm}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
