"""APRIL partial rollouts against synchronous groups on a long-tail task.

    rollwise bench april [--steps 20] [--repeats 3] [key=value ...]
    rollwise bench april --config smollm2 generate.max_new_tokens=256 [...]

The built-in tiers with two kinds of "thinking" before the answer give long-tailed response
lengths: most worked solutions think briefly ('.' filler, geometric, mean task.filler_mean)
and a tenth think long (',' filler, mean task.filler_tail_mean), so most synchronous steps wait
for a few long responses. Both modes start from the same warm-start model, train for the same
number of steps with the same budget (prompts_per_step groups of group_size), and report
rollout-phase throughput: tokens of the groups handed to the trainer per second of generation.
A token counts when its group is trained on: APRIL's carried samples count in the step that
trains them, and what is still carried at the end counts nowhere (its generation time does).
The run fails if decoded tokens != trained + carried tokens.

With --config the run is that config's (its model, task and prompts) with the same schedule
settings; a real model's own response lengths give the tail (a few ramble to the cap).

Also reported: trained tokens per model forward pass (decode tick), the cost model in which
a tick costs the same however many rows it holds, which is what a memory-bound GPU decoder
pays. On a CPU a pass costs more the more rows it has, so the wall-clock gain is smaller than
the tick gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rollwise import models
from rollwise.config import load_config
from rollwise.loop.metrics import step_metrics
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
from rollwise.tasks import load_task
from rollwise.training.sft import warm_start

TASK_DEFAULTS = ["task.filler_mean=4", "task.filler_tail=0.1", "task.filler_tail_mean=60",
                 "generate.max_new_tokens=192", "sft.steps=300"]  # the built-in long tail
RUN_DEFAULTS = ["control.prompts_per_step=8", "filter.drop_equal_reward_groups=false",
                "run.eval_every=1000", "run.log=quiet", "run.report=false"]


def run_mode(base: list[str], mode: str, steps: int, root: str, init: str | None,
             config: str | None = None) -> dict:
    """One run of `steps` under control.inflight=mode, from `init` (None: the config's model)."""
    cfg = load_config(config, base + [f"control.inflight={mode}", f"train.steps={steps}",
                                      f"run.root={root}", f"run.name=april-{mode}"]
                      + ([f"run.init={init}"] if init else []))
    with Run(cfg, Progress("quiet")) as run:
        engine = run.engine
        decoded0, prefill0, passes0 = (engine.tokens_generated, engine.prefill_tokens,
                                       engine.forward_passes)
        rows = [step_metrics(run.step(step)) for step in range(1, steps + 1)]
        gen_s = sum(r["perf/gen_seconds"] for r in rows)
        batch = sum(r["tokens/batch"] for r in rows)
        decoded = engine.tokens_generated - decoded0
        passes = engine.forward_passes - passes0
        carried = rows[-1].get("tokens/paused_carried", 0.0)
        if decoded != batch + carried:  # every sampled token is trained on or still carried
            raise RuntimeError(f"{mode}: {decoded} tokens decoded but {batch} trained + "
                               f"{carried} carried")
        per_step = [r["tokens/batch"] / r["perf/gen_seconds"] for r in rows[1:]]  # after step 1
        return {"mode": mode, "gen_seconds": gen_s, "batch_tokens": batch,
                "decoded_tokens": decoded, "prefill_tokens": engine.prefill_tokens - prefill0,
                "ticks": passes, "throughput": batch / gen_s,
                "step_throughput_median": statistics.median(per_step) if per_step else None,
                "tokens_per_tick": batch / passes,
                "stale_tokens": sum(r["tokens/stale"] for r in rows),
                "carried_tokens_end": carried,
                "mean_length": statistics.mean(r["response/length_mean"] for r in rows)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench april", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", default="runs/bench-april")
    p.add_argument("--json", action="store_true")
    p.add_argument("--config", help="a run's config (its model and task) instead of the "
                                    "built-in long-tail task")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    init = None
    if args.config:
        base = RUN_DEFAULTS + args.overrides
        load_config(args.config, base)  # a bad key fails here, before any run
    else:
        base = TASK_DEFAULTS + RUN_DEFAULTS + args.overrides
        cfg = load_config(None, base + [f"run.root={args.root}"])
        model, tok = warm_start(cfg, load_task(cfg.task), log=lambda m: None)
        init = f"{args.root}/warm-start"
        models.save(model, tok, init)
    results = {"none": [], "april": []}
    for r in range(args.repeats):  # alternate the order so drift hits both modes alike
        for mode in (("none", "april") if r % 2 == 0 else ("april", "none")):
            results[mode].append(run_mode(base, mode, args.steps, args.root, init,
                                          args.config))
    med = {m: statistics.median(x["throughput"] for x in rs) for m, rs in results.items()}
    ratios = [a["throughput"] / s["throughput"] for a, s in zip(results["april"],
                                                                 results["none"])]
    tick_ratios = [a["tokens_per_tick"] / s["tokens_per_tick"]
                   for a, s in zip(results["april"], results["none"])]
    out = {"steps": args.steps, "repeats": args.repeats, "runs": results,
           "median_throughput": med, "speedup_median": statistics.median(ratios),
           "speedups": ratios, "tick_speedup_median": statistics.median(tick_ratios),
           "tick_speedups": tick_ratios}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cols = [("gen_seconds", ".2f"), ("batch_tokens", ".0f"), ("decoded_tokens", ".0f"),
            ("carried_tokens_end", ".0f"), ("prefill_tokens", ".0f"), ("ticks", ".0f"),
            ("tokens_per_tick", ".1f"), ("stale_tokens", ".0f")]
    print("| mode | trained tokens/s | " + " | ".join(c.replace("_", " ") for c, _ in cols)
          + " |")
    print("|---|---|" + "---|" * len(cols))
    for m, label in (("none", "synchronous groups"), ("april", "APRIL")):
        rs = results[m]
        print(f"| {label} | {med[m]:.0f} | " + " | ".join(
            format(statistics.median(x[c] for x in rs), f) for c, f in cols) + " |")
    print(f"\nAPRIL / synchronous, trained tokens per second of generation: "
          f"{out['speedup_median']:.2f}x (median of {args.repeats} paired runs: "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"APRIL / synchronous, trained tokens per engine forward pass (decode tick): "
          f"{out['tick_speedup_median']:.2f}x ({', '.join(f'{x:.2f}' for x in tick_ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
