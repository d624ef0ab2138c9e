"""Prompt selection: uniform, DAPO dynamic sampling, Thompson (MoPPS) and DPS.

    rollwise bench select [--seeds 0 1 2] [--target 0.73] [--max-steps 200] [key=value ...]

Methods: uniform, dynamic (DAPO dynamic sampling, each refill round generating only the groups
still missing, up to control.max_rounds), dynamic-full (the same as verl's DAPO recipe runs it
in the DPS paper: a whole batch every round, at most 4 rounds), thompson, dps.

Each method trains from the same warm start on a small pool of prompts that recur (so
per-prompt statistics can be learned), most of them solved or out of reach. Reported per
method: the share of generated groups with mixed rewards, and the rollouts (samples generated,
discarded groups included) needed until held-out pass@1 first reaches the target, median over
seeds. A run that never reaches it counts as not reached (its rollouts at max steps are shown
with '>').

The warm start is the default one (model.* and sft.* overrides apply; the task mix and pool
size do not): SFT on the small RL pool itself would memorize each prompt's noisy answer.
`--warm key=value` (repeatable) overrides apply to the warm start only, e.g. its own tier mix
(`--warm 'task.tiers={add2: 0.5, sub2: 0.5}' --warm 'sft.noise={sub2: 0.6}'`).
Held-out pass@1 is measured whenever --eval-rollouts more samples have been generated, so every
method is judged at the same rollout granularity (a dynamic-sampling step larger than that is
evaluated after each step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rollwise import models
from rollwise.bench.select_readout import report
from rollwise.bench.target import reaches
from rollwise.config import load_config
from rollwise.loop.metrics import step_metrics
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
from rollwise.stages.control.stage import prompt_outcomes
from rollwise.tasks import load_task
from rollwise.training.sft import warm_start

METHODS = {
    "uniform": ["control.selector=uniform"],
    "dynamic": ["control.selector=uniform", "control.dynamic_sampling=true"],
    # verl's DAPO recipe as the DPS paper's baseline runs it (maoyixiu/DPS math scripts:
    # gen_batch_size = train_batch_size, max_num_gen_batches = 4)
    "dynamic-full": ["control.selector=uniform", "control.dynamic_sampling=true",
                     "control.refill=full", "control.max_rounds=4"],
    "thompson": ["control.selector=thompson"],
    "dps": ["control.selector=dps"],
}
DEFAULTS = ["task.train_size=512", "run.log=quiet", "run.report=false", "run.eval_every=1000"]


def run_method(base: list[str], method: str, seed: int, target: float, max_steps: int,
               eval_rollouts: int, root: str, init: str) -> dict:
    cfg = load_config(None, base + METHODS[method] + [
        f"run.seed={seed}", f"train.steps={max_steps}", f"run.root={root}",
        f"run.name=select-{method}-{seed}", f"run.init={init}"])
    with Run(cfg, Progress("quiet")) as run:
        tiers = {p.id: p.tier for p in run.task.train}
        by_tier: dict[str, list[int]] = {}  # tier -> [groups scored, groups with mixed rewards]
        mixed = scored = trained = 0
        reached, curve, next_eval = None, [], eval_rollouts
        for step in range(1, max_steps + 1):
            result = run.step(step)
            for pid, (succ, trials) in prompt_outcomes(result.scored).items():  # kept or not
                t = by_tier.setdefault(tiers[pid], [0, 0])
                t[0] += 1
                t[1] += 0 < succ < trials
            m = step_metrics(result)
            mixed += m["groups/mixed_share"] * m["groups/scored"]
            scored += m["groups/scored"]
            trained += m["groups/trained"]
            if run.totals["rollouts"] >= next_eval or step == max_steps:
                next_eval = run.totals["rollouts"] + eval_rollouts
                ev = run.evaluate()
                curve.append((step, run.totals["rollouts"], ev["eval/pass1"]))
                if reaches(ev["eval/pass1"], target):
                    reached = {"step": step, "rollouts": run.totals["rollouts"]}
                    break
        return {"method": method, "seed": seed, "mixed_share": mixed / scored, "reached": reached,
                "rollouts_total": run.totals["rollouts"], "steps": step, "groups_scored": scored,
                "groups_trained": trained, "eval_end": ev, "curve": curve, "tiers": by_tier}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench select", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--target", type=float, default=0.73)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--eval-rollouts", type=int, default=1280,
                   help="evaluate held-out pass@1 every this many generated samples")
    p.add_argument("--init", help="start every run from this model folder (no warm start)")
    p.add_argument("--warm", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the warm start only (repeatable)")
    p.add_argument("--root", default="runs/bench-select")
    p.add_argument("--json", action="store_true")
    p.add_argument("--progress", action="store_true", help="print each run's curve as it ends")
    p.add_argument("--readout", nargs="+", metavar="LOG",
                   help="run nothing: read --progress logs back (rollwise.bench.select_readout)")
    p.add_argument("--targets", type=float, nargs="+",
                   help="with --readout: targets to read (default: --target)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.targets and not args.readout:
        p.error("--targets reads saved logs: pass them with --readout LOG ...")
    if args.readout:
        print(report(args.readout, args.targets or [args.target]))
        return 0
    base = DEFAULTS + args.overrides
    init = args.init
    if init is None:
        warm = [o for o in args.overrides if o.startswith(("model.", "sft."))] + args.warm
        cfg = load_config(None, warm + [f"run.root={args.root}"])
        model, tok = warm_start(cfg, load_task(cfg.task), log=lambda m: None)
        init = f"{args.root}/warm-start"
        models.save(model, tok, init)
    rows = []
    for s in args.seeds:
        for m in args.methods:
            rows.append(run_method(base, m, s, args.target, args.max_steps, args.eval_rollouts,
                                   args.root, init))
            if args.progress:
                r = rows[-1]
                print(f"# {m} seed {s}: mixed {r['mixed_share']:.2f} reached {r['reached']} "
                      f"rollouts {r['rollouts_total']} steps {r['steps']} tiers (groups, "
                      f"mixed) {r['tiers']} curve "
                      f"{[(c[0], c[1], round(c[2], 3)) for c in r['curve']]}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"target held-out pass@1 {args.target}, seeds {args.seeds}, at most "
          f"{args.max_steps} steps\n")
    print("| method | mixed-reward groups | rollouts to target (median) | steps to target "
          "(median) | reached |")
    print("|---|---|---|---|---|")
    medians = {}
    for m in args.methods:
        rs = [r for r in rows if r["method"] == m]
        need = [r["reached"]["rollouts"] if r["reached"] else float("inf") for r in rs]
        steps = [r["reached"]["step"] if r["reached"] else float("inf") for r in rs]
        medians[m] = statistics.median(need)
        shown = (f"{medians[m]:.0f}" if medians[m] != float("inf")
                 else f">{max(r['rollouts_total'] for r in rs)}")
        st = statistics.median(steps)
        print(f"| {m} | {statistics.mean(r['mixed_share'] for r in rs):.2f} | {shown} | "
              f"{st if st != float('inf') else '-'} | {sum(bool(r['reached']) for r in rs)}/"
              f"{len(rs)} |")
    print()
    for ds in ("dynamic", "dynamic-full"):
        if "dps" in medians and ds in medians and medians[ds] != float("inf"):
            print(f"DPS / {ds} rollouts: {medians['dps'] / medians[ds]:.2f}")
    if "dps" in medians and "uniform" in medians and medians["uniform"] != float("inf"):
        print(f"DPS / uniform rollouts: {medians['dps'] / medians['uniform']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
