"""Tree rollouts against i.i.d. groups at an equal generated-token budget, on the stepped task.

    rollwise bench trees [--seeds 0 1 2] [--parts latr echo] [--jobs N] [--json] [key=value ...]

Two parts, each from one warm start shared by its arms, every arm decoding the same budget of
generated tokens (pruned branches count), held-out greedy pass@1 every --eval-every steps:

- latr: plain GRPO (i.i.d. groups) against LATR (generate.strategy=latr), rewards from the
  true answers, on configs/stepped.yaml's warm start. Reported: tokens and steps to the
  held-out target (warm start + --gain), share of groups with mixed rewards, distinct final
  answers per group, forks, pruned branches and prefix tokens saved.
- echo: test-time RL on unlabeled prompts (filter.reward=majority: the reward never reads the
  answers) with i.i.d. groups against ECHO (generate.strategy=echo with its token shaping and
  adaptive clip, its thresholds set for the tiny model: ECHO_TINY) at --ttrl-lr. Its warm start
  has the teacher right on most steps (--ttrl-noise), since TTRL needs a majority that is
  mostly right (docs/methods.md#echo). Reported: pseudo-label accuracy
  (filter/majority_label_acc, mean over the last quarter of steps) and final held-out pass@1,
  sampled (4 draws at T = 1), as TTRL reports it: greedy decoding already picks the majority.

Top-level JSON keys: latr_tokens_to_target_ratio (LATR's median tokens to target / i.i.d.'s; a
run that misses the target counts its whole budget, reached: false), latr_mixed_share_ratio
(LATR's mean mixed share / i.i.d.'s), echo_ttrl_pass1_delta (ECHO's final pass@1 minus
i.i.d.'s, mean over seeds), echo_label_acc_delta (the same for pseudo-label accuracy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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

CONFIG = str(PRESETS / "stepped.yaml")
# ECHO's released thresholds are for a 7B model's top-10 statistics (and H >= 3.5 nats is
# above ln 10, the most a renormalised top-10 entropy can be). These are set from the tiny
# warm start's statistics (BENCHMARKS.md, "Tree rollouts: LATR and ECHO"), not from
# the bench's outcome: H >= 0.3 marks the ~5 % of tokens where two digits are plausible, where
# C_g sits at 6.2-6.5 and dH at 0.5-0.75; the third token there has p <= 0.03, so one
# alternative (max_width 1); the prune rules cut below the warm start's lowest confidence
# (C_g 0.1 % quantile 6.04) and on entropy rising past a two-way split (> ln 2).
ECHO_TINY = ["generate.echo.entropy_threshold=0.3", "generate.echo.entropy_floor=0.03",
             "generate.echo.conf_threshold=6.6", "generate.echo.max_width=1",
             "generate.echo.min_group_conf=5.5", "generate.echo.tail_conf=6.0",
             "generate.echo.delta_rise=0.8"]
ARMS = {
    "latr": {"iid": ["generate.strategy=group"], "latr": ["generate.strategy=latr"]},
    "echo": {"iid": ["generate.strategy=group", "filter.reward=majority"],
             "echo": ["generate.strategy=echo", "filter.reward=majority",
                      "train.token_shaping=echo", "train.adaptive_clip=echo"] + ECHO_TINY},
}


def distinct_answers(run, groups) -> float:
    """Mean number of distinct extracted final answers per group (None counts as one)."""
    def answer(s):
        return run.task.extract_answer(run.decode(s.response_ids))
    return statistics.mean(len({answer(s) for s in g.samples}) for g in groups)


def run_arm(overrides: list[str], part: str, arm: str, seed: int, tokens: int,
            eval_every: int, gain: float, root: str, init: str) -> dict:
    """One arm of one part: steps until `tokens` generated tokens are decoded."""
    steps = []

    def observe(run, r, m):
        steps.append({"mixed": m["groups/mixed_share"], "distinct": distinct_answers(run, r.scored),
                      "forks": sum(v for k, v in m.items()
                                   if k.startswith("decisions/generate/fork")),
                      "pruned": sum(v for k, v in m.items()
                                    if k.startswith("decisions/generate/prune")),
                      "prefix_saved": m.get("tokens/prefix_saved", 0.0),
                      "label_acc": m.get("filter/majority_label_acc")})
    t = train_to_budget(CONFIG, overrides + [
        f"run.seed={seed}", f"run.root={root}", f"run.name={part}-{arm}-{seed}",
        f"run.init={init}"], tokens, eval_every, observe)
    curve = t["curve"]
    start = curve[0]["pass1"]
    target = start + gain
    hit = first_reach(curve, target)
    acc = [s["label_acc"] for s in steps[-max(len(steps) // 4, 1):] if s["label_acc"] is not None]
    return {"part": part, "arm": arm, "seed": seed, "steps": t["steps"], "tokens": t["tokens"],
            "seconds": t["seconds"], "start_pass1": start, "final_pass1": curve[-1]["pass1"],
            "target": target, "reached": hit is not None,
            "tokens_to_target": hit["tokens"] if hit else t["tokens"],
            "steps_to_target": hit["step"] if hit else t["steps"],
            "mixed_share": statistics.mean(s["mixed"] for s in steps),
            "distinct_answers": statistics.mean(s["distinct"] for s in steps),
            "forks": sum(s["forks"] for s in steps), "pruned": sum(s["pruned"] for s in steps),
            "prefix_saved": sum(s["prefix_saved"] for s in steps),
            "label_acc": statistics.mean(acc) if acc else None, "curve": curve}


def _run(*job) -> dict:
    r = run_arm(*job)
    print(f"{r['part']}/{r['arm']} seed {r['seed']}: {r['steps']} steps, {r['tokens']:.0f} "
          f"tokens, pass@1 {r['start_pass1']:.3f} -> {r['final_pass1']:.3f}, to target "
          f"{r['tokens_to_target']:.0f}{'' if r['reached'] else ' (not reached)'}, mixed "
          f"{r['mixed_share']:.3f}, forks {r['forks']:.0f}", file=sys.stderr, flush=True)
    return r


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    by = {(r["part"], r["arm"]): [] for r in runs}
    for r in runs:
        by[(r["part"], r["arm"])].append(r)
    keys = ("tokens_to_target", "steps_to_target", "final_pass1", "mixed_share",
            "distinct_answers", "forks", "pruned", "prefix_saved", "seconds")
    med = {f"{p}/{a}": {k: statistics.median(r[k] for r in rs) for k in keys}
           for (p, a), rs in by.items()}
    for (p, a), rs in by.items():
        med[f"{p}/{a}"]["reached"] = sum(r["reached"] for r in rs)
        accs = [r["label_acc"] for r in rs if r["label_acc"] is not None]
        med[f"{p}/{a}"]["label_acc"] = statistics.mean(accs) if accs else None
    out: dict = {"medians": med}

    def paired(part, a, b, key):
        x = {r["seed"]: r[key] for r in by.get((part, a), [])}
        y = {r["seed"]: r[key] for r in by.get((part, b), [])}
        pairs = [x[s] - y[s] for s in seeds if s in x and s in y and x[s] is not None
                 and y[s] is not None]
        return statistics.mean(pairs) if pairs else None
    if "latr/latr" in med and "latr/iid" in med:
        iid, latr = med["latr/iid"], med["latr/latr"]
        out["latr_tokens_to_target_ratio"] = latr["tokens_to_target"] / iid["tokens_to_target"]
        out["latr_mixed_share_ratio"] = (
            statistics.mean(r["mixed_share"] for r in by[("latr", "latr")])
            / max(statistics.mean(r["mixed_share"] for r in by[("latr", "iid")]), 1e-9))
    if "echo/echo" in med and "echo/iid" in med:
        out["echo_ttrl_pass1_delta"] = paired("echo", "echo", "iid", "final_pass1")
        out["echo_label_acc_delta"] = paired("echo", "echo", "iid", "label_acc")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench trees", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parts", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--tokens", type=int, default=2_000_000,
                   help="generated-token budget of each latr-part run")
    p.add_argument("--ttrl-tokens", type=int, default=1_400_000,
                   help="generated-token budget of each echo-part run")
    p.add_argument("--gain", type=float, default=0.2,
                   help="held-out target: the warm start's pass@1 plus this")
    p.add_argument("--ttrl-noise", type=float, default=0.4,
                   help="sft.noise of the echo part's warm start (its teacher's wrong-fact share)")
    p.add_argument("--init", help="the latr part's warm-start model folder (default: SFT here)")
    p.add_argument("--ttrl-init", help="the echo part's warm-start model folder")
    p.add_argument("--ttrl-lr", type=float, default=1e-5,
                   help="the echo part's learning rate (stepped.yaml's 2e-6 moves no TTRL arm "
                        "in its budget)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--jobs", type=int, default=1,
                   help="runs side by side in this many processes (one torch thread each)")
    p.add_argument("--root", default="runs/bench-trees")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = p.parse_args(argv)
    # TTRL reports sampled pass@1 (greedy decoding already picks the majority's answer)
    part_overrides = {"latr": [], "echo": [f"sft.noise={args.ttrl_noise}", "run.eval_samples=4",
                                           "run.eval_temperature=1.0", f"train.lr={args.ttrl_lr}"]}
    budget = {"latr": args.tokens, "echo": args.ttrl_tokens}
    threads = ["run.threads=1"] if args.jobs > 1 else []
    given = {"latr": args.init, "echo": args.ttrl_init}
    jobs = []
    for part in args.parts:
        init = given[part] or warm_start_folder(
            CONFIG, BENCH_RUN + part_overrides[part] + args.overrides, args.root)
        for seed in args.seeds:
            for arm, arm_overrides in ARMS[part].items():  # the command's overrides win
                jobs.append((BENCH_RUN + part_overrides[part] + arm_overrides + args.overrides
                             + threads, part, arm, seed, budget[part], args.eval_every,
                             args.gain, args.root, init))
    runs, failed = execute(_run, jobs, args.jobs, Path(args.root) / "runs.jsonl",
                           lambda j: {"part": j[1], "arm": j[2], "seed": j[3]})
    out = {"tokens": budget, "gain": args.gain, "seeds": args.seeds,
           "overrides": args.overrides, **summarize(runs, args.seeds), "runs": runs,
           "failed": failed}
    if args.json:
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    print("| part/arm | tokens to target | steps to target | reached | final pass@1 | mixed share "
          "| distinct answers | forks | pruned | prefix saved | pseudo-label acc |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, v in out["medians"].items():
        acc = "–" if v["label_acc"] is None else f"{v['label_acc']:.3f}"
        print(f"| {k} | {v['tokens_to_target']:.0f} | {v['steps_to_target']:.0f} | "
              f"{v['reached']}/{len(args.seeds)} | {v['final_pass1']:.3f} | "
              f"{v['mixed_share']:.3f} | {v['distinct_answers']:.2f} | {v['forks']:.0f} | "
              f"{v['pruned']:.0f} | {v['prefix_saved']:.0f} | {acc} |")
    return print_keys_and_failures(
        out, ("latr_tokens_to_target_ratio", "latr_mixed_share_ratio", "echo_ttrl_pass1_delta",
              "echo_label_acc_delta"), failed, lambda r: f"{r['part']}/{r['arm']}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
