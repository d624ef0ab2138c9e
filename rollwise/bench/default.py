"""The default embedded run for several seeds, warm start included (cache cleared first).

    rollwise bench default --seeds 0 1 2 [key=value ...]

Prints held-out greedy pass@1 at start and end (overall and per tier) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from rollwise.config import load_config
from rollwise.loop.run import train


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--config")
    p.add_argument("--root", default="runs/bench-default")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        shutil.rmtree(Path(args.root) / ".cache", ignore_errors=True)  # time the warm start too
        cfg = load_config(args.config, [*args.overrides, f"run.seed={seed}",
                                        f"run.root={args.root}", f"run.name=seed{seed}",
                                        "run.log=plain"])
        s = train(cfg)
        rows.append({"seed": seed, "start": s["eval_pass1_start"], "end": s["eval_pass1_end"],
                     "gain": s["eval_pass1_end"] - s["eval_pass1_start"],
                     "wall_seconds": s["wall_seconds"], "eval_start": s["eval_start"],
                     "eval_end": s["eval_end"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    tiers = sorted(k.split("/")[-1] for k in rows[0]["eval_end"] if k.count("/") == 2)
    head = "| seed | pass@1 start | pass@1 end | gain | " + " | ".join(
        f"{t} start→end" for t in tiers) + " | wall s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        start, end = r["eval_start"], r["eval_end"]
        per = " | ".join(f"{start[f'eval/pass1/{t}']:.2f}→{end[f'eval/pass1/{t}']:.2f}"
                         for t in tiers)
        print(f"| {r['seed']} | {r['start']:.3f} | {r['end']:.3f} | {r['gain']:+.3f} | {per} | "
              f"{r['wall_seconds']:.0f} |")
    med = {k: statistics.median(r[k] for r in rows) for k in ("start", "end", "gain",
                                                             "wall_seconds")}
    print(f"| median | {med['start']:.3f} | {med['end']:.3f} | {med['gain']:+.3f} | "
          + " | ".join("" for _ in tiers) + f" | {med['wall_seconds']:.0f} |")
    return 0
