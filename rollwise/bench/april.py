"""APRIL partial rollouts against synchronous groups on a long-tail task.

    rollwise bench april [--steps 8] [--repeats 3] [key=value ...]

The built-in tiers with geometric '.' filler before the answer (task.filler_mean) give
long-tailed response lengths. Both modes start from the same warm-start model, train for the
same number of steps with the same budget (prompts_per_step groups of group_size), and report
rollout-phase throughput: tokens of the groups handed to the trainer per second of generation.
"""

from __future__ import annotations

import argparse
import json
import statistics

from rollwise.config import load_config

DEFAULTS = ["task.filler_mean=4", "generate.max_new_tokens=64", "sft.steps=800",
            "filter.drop_equal_reward_groups=false", "run.eval_every=1000", "run.log=quiet",
            "run.report=false"]


def run_mode(base: list[str], mode: str, steps: int, root: str, init: str) -> dict:
    from rollwise.loop.sync import Run
    from rollwise.report.progress import Progress
    cfg = load_config(None, base + [f"control.inflight={mode}", f"train.steps={steps}",
                                    f"run.root={root}", f"run.name=april-{mode}",
                                    f"run.init={init}"])
    run = Run(cfg, Progress("quiet"))
    rows = [run.step(step) for step in range(1, steps + 1)]
    gen_s = sum(r["perf/gen_seconds"] for r in rows)
    batch = sum(r["tokens/batch"] for r in rows)
    generated = sum(r["tokens/generated"] for r in rows)
    return {"mode": mode, "gen_seconds": gen_s, "batch_tokens": batch,
            "generated_tokens": generated, "throughput": batch / gen_s,
            "stale_tokens": sum(r["tokens/stale"] for r in rows),
            "carried_tokens_end": rows[-1].get("tokens/paused_carried", 0.0),
            "median_length": statistics.median(r["response/length_mean"] for r in rows)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench april", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", default="runs/bench-april")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from rollwise import models
    from rollwise.tasks import load_task
    from rollwise.train.sft import warm_start
    base = DEFAULTS + args.overrides
    cfg = load_config(None, base + [f"run.root={args.root}"])
    model, tok = warm_start(cfg, load_task(cfg.task), log=lambda m: None)
    init = f"{args.root}/warm-start"
    models.save(model, tok, init)
    results = {"none": [], "april": []}
    for r in range(args.repeats):  # alternate the order so drift hits both modes alike
        for mode in (("none", "april") if r % 2 == 0 else ("april", "none")):
            results[mode].append(run_mode(base, mode, args.steps, args.root, init))
    med = {m: statistics.median(x["throughput"] for x in rs) for m, rs in results.items()}
    ratios = [a["throughput"] / s["throughput"] for a, s in zip(results["april"],
                                                                 results["none"])]
    out = {"steps": args.steps, "repeats": args.repeats, "runs": results,
           "median_throughput": med, "speedup_median": statistics.median(ratios),
           "speedups": ratios}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print("| mode | batch tokens/s (median) | gen s per run | generated tokens | stale tokens |")
    print("|---|---|---|---|---|")
    for m, label in (("none", "synchronous groups"), ("april", "APRIL")):
        rs = results[m]
        print(f"| {label} | {med[m]:.0f} | {statistics.median(x['gen_seconds'] for x in rs):.1f}"
              f" | {statistics.median(x['generated_tokens'] for x in rs):.0f} | "
              f"{statistics.median(x['stale_tokens'] for x in rs):.0f} |")
    print(f"\nAPRIL / synchronous throughput: {out['speedup_median']:.2f}x (median of "
          f"{args.repeats} paired runs: {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0
