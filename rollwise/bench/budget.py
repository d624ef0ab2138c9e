"""Rollout budgets at equal compute: GRPO with a fixed group size against ARRoL, DUET at 100 %
and 50 % of the budget, sGPO and DARS.

    rollwise bench budget [--task stepped|longtail] [--seeds 0 1 2] [--tokens N] [--json]
                          [key=value ...]

Every method starts from the same warm-start model and trains until it has decoded its share
of one budget of generated tokens (--tokens; DUET-50 gets half): the tokens the engine decoded,
so sGPO's profiling pass, ARRoL's pruned prefixes and DUET's aborted tails all count. Held-out
greedy pass@1 is measured every --eval-every steps and at the end (evaluation time is not
counted). Reported per method and seed: decoded tokens and seconds (generation + training) to
the held-out target, the final pass@1, and for ARRoL the quality head's AUC over training.

Tasks (--task):
- stepped (default): configs/stepped.yaml, scratchpad additions (21-33-token
  responses), its SFT warm start (--init, or trained here and cached), held-out greedy pass@1,
  target = the warm start's pass@1 + --gain. ARRoL scores at T_p = 16 tokens (TASKS).
- longtail: APRIL's long-tail task, tails shortened (TASKS): most answers come after a short
  filler, a tenth after a long one; sampled pass@1; target --target.

Top-level JSON keys: arrol_speedup (GRPO's median tokens to target / ARRoL's), duet50_pass1_delta
(DUET-50's final pass@1 minus GRPO's, mean over seeds), sgpo_compute_ratio (sGPO's median tokens
to target / GRPO's). A method that never reaches the target counts its whole budget there, and
the JSON says so (reached: false).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rollwise.bench.jobs import (
    BENCH_RUN,
    execute,
    print_keys_and_failures,
    train_to_budget,
    warm_start_folder,
)
from rollwise.bench.target import first_reach
from rollwise.presets import PRESETS


@dataclass(frozen=True)
class TaskSetup:
    config: str | None  # the run config the overrides apply to (None: the defaults)
    overrides: list[str]
    tokens: int  # generated-token budget per run
    eval_every: int
    target: float | None  # None: the warm start's pass@1 + --gain


TASKS = {
    # ARRoL's T_p = 16 tokens: a 2-digit scratchpad's first two columns, half of a 3-digit one
    "stepped": TaskSetup(str(PRESETS / "stepped.yaml"),
                         BENCH_RUN + ["control.arrol.checkpoint=16"], 1_400_000, 5, None),
    # APRIL's long-tail task, tails shortened (means 2 and 24 instead of 4 and 60) so that the
    # default run's warm start (2000 supervised steps) takes 8 minutes here instead of about
    # 100. Greedy decoding never leaves a geometric filler ('.' continues with probability
    # 2/3), so pass@1 is the mean success of 4 draws at temperature 1 (unbiased).
    "longtail": TaskSetup(None, ["task.filler_mean=2", "task.filler_tail=0.1",
                                 "task.filler_tail_mean=24", "generate.max_new_tokens=128",
                                 "engine.segment=4", "task.eval_size=200", "run.eval_samples=4",
                                 "run.eval_temperature=1.0"] + BENCH_RUN, 100_000, 3, 0.7),
}
METHODS = {
    "grpo": [],
    "arrol": ["control.inflight=arrol"],
    "duet100": ["control.inflight=duet", "control.duet.budget=1.0"],
    "duet50": ["control.inflight=duet", "control.duet.budget=0.5"],
    "sgpo": ["control.group_size=sgpo", "control.sgpo.profile_prompts=256"],
    "dars": ["control.group_size=dars"],
}
BUDGET_SHARE = {"duet50": 0.5}


def run_method(config: str | None, overrides: list[str], method: str, seed: int, tokens: int,
               eval_every: int, target: float | None, gain: float, root: str,
               init: str) -> dict:
    """One run: overrides are the task's defaults, the method's settings and the command's.
    target None: the start's pass@1 + gain."""
    aucs = []

    def observe(run, r, m):
        if "arrol/head_auc" in m:
            aucs.append({"step": run.current_step, "auc": m["arrol/head_auc"]})
    t = train_to_budget(config, overrides + [
        f"run.seed={seed}", f"run.root={root}", f"run.name={method}-{seed}",
        f"run.init={init}"], tokens * BUDGET_SHARE.get(method, 1.0), eval_every, observe)
    curve = t["curve"]
    goal = curve[0]["pass1"] + gain if target is None else target
    hit = first_reach(curve, goal)
    return {"method": method, "seed": seed, "target": goal, "steps": t["steps"],
            "tokens": t["tokens"], "seconds": t["seconds"], "final_pass1": curve[-1]["pass1"],
            "start_pass1": curve[0]["pass1"], "reached": hit is not None,
            "tokens_to_target": hit["tokens"] if hit else t["tokens"],
            "seconds_to_target": hit["seconds"] if hit else t["seconds"],
            "curve": curve, "head_auc": aucs}


def _run(*job) -> dict:
    return _report(run_method(*job))


def _report(r: dict) -> dict:
    print(f"{r['method']} seed {r['seed']}: {r['steps']} steps, {r['tokens']:.0f} tokens, "
          f"pass@1 {r['start_pass1']:.3f} -> {r['final_pass1']:.3f}, to target: "
          f"{r['tokens_to_target']:.0f} tokens{'' if r['reached'] else ' (not reached)'}",
          file=sys.stderr, flush=True)
    return r


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    by = {m: [r for r in runs if r["method"] == m] for m in METHODS}
    med = {m: {k: statistics.median(r[k] for r in rs) for k in
               ("tokens_to_target", "seconds_to_target", "final_pass1", "tokens")}
           for m, rs in by.items() if rs}
    final = {m: {r["seed"]: r["final_pass1"] for r in rs} for m, rs in by.items()}

    def delta(a, b):
        pairs = [final[a][s] - final[b][s] for s in seeds if s in final[a] and s in final[b]]
        return statistics.mean(pairs) if pairs else None
    grpo = med.get("grpo", {})
    out = {"medians": med}
    if "arrol" in med and grpo:
        out["arrol_speedup"] = grpo["tokens_to_target"] / med["arrol"]["tokens_to_target"]
        out["arrol_pass1_delta"] = delta("arrol", "grpo")
    if "duet50" in med and grpo:
        out["duet50_pass1_delta"] = delta("duet50", "grpo")
    if "duet100" in med and grpo:
        out["duet100_pass1_delta"] = delta("duet100", "grpo")
    if "sgpo" in med and grpo:
        out["sgpo_compute_ratio"] = med["sgpo"]["tokens_to_target"] / grpo["tokens_to_target"]
    if "dars" in med and grpo:
        out["dars_compute_ratio"] = med["dars"]["tokens_to_target"] / grpo["tokens_to_target"]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), default="stepped")
    p.add_argument("--init", help="warm-start model folder (default: SFT here, cached)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--tokens", type=int, default=None,
                   help="generated-token budget of each run (DUET-50: half); default 1.4M "
                        "(stepped), 100k (longtail)")
    p.add_argument("--target", type=float, default=None,
                   help="held-out pass@1 target (default: stepped, the start + --gain; "
                        "longtail, 0.7)")
    p.add_argument("--gain", type=float, default=0.2)
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between evaluations (default 5 stepped, 3 longtail)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs side by side in this many processes (one torch thread each)")
    p.add_argument("--root", default="runs/bench-budget")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    tokens = args.tokens or task.tokens
    eval_every = args.eval_every or task.eval_every
    target = task.target if args.target is None else args.target
    init = args.init or warm_start_folder(task.config, task.overrides + args.overrides, args.root)
    threads = ["run.threads=1"] if args.jobs > 1 else []
    # the command's overrides come last: they win over a method's own settings
    jobs = [(task.config, task.overrides + METHODS[m] + args.overrides + threads, m, seed,
             tokens, eval_every, target, args.gain, args.root, init)
            for seed in args.seeds for m in args.methods]
    runs, failed = execute(_run, jobs, args.jobs, Path(args.root) / "runs.jsonl",
                           lambda j: {"method": j[2], "seed": j[3]})
    out = {"task": args.task, "tokens": tokens, "target": target, "gain": args.gain,
           "init": init, "seeds": args.seeds, "overrides": args.overrides,
           **summarize(runs, args.seeds), "runs": runs,
           "failed": failed}
    if args.json:
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    print("| method | tokens to target | s to target | final pass@1 | reached (seeds) |")
    print("|---|---|---|---|---|")
    for m, v in out["medians"].items():
        reached = sum(r["reached"] for r in runs if r["method"] == m)
        print(f"| {m} | {v['tokens_to_target']:.0f} | {v['seconds_to_target']:.0f} | "
              f"{v['final_pass1']:.3f} | {reached}/{len(args.seeds)} |")
    return print_keys_and_failures(out, ("arrol_speedup", "duet50_pass1_delta",
                                         "sgpo_compute_ratio"), failed, lambda r: r["method"])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
