"""Agent training on the built-in environments, 3 seeds from one warm start per task:

    rollwise bench agents --json [--seeds 0 1 2] [key=value ...]

- tool: configs/calc.yaml (products only the calculator gets right). Held-out sampled
  pass@1 before and after RL; the hardest tier (mul3) solved with and without a call.
- cod: configs/packs.yaml (Connect-the-Dots). After RL, the slope of solve success on the
  task's position in an eval pack (8 tasks), with the pack's own hints and with hints shuffled
  across packs.
- trace: configs/chain3.yaml (three-hop products in groups of 4: the decisions to learn sit
  after the first and second calls, the multi-hop shape TRACE is for, and i.i.d. groups are
  often all-fail; --trace-config picks another task) with generate.strategy=trace: TRACE's
  allocation at the sampled tokens root-only allocation would spend
  (generate.trace.budget=tokens), against that budget spent on the prompts only
  (generate.trace.allocation=root, i.i.d. groups). Mixed-reward sibling sets per sampled token
  over the run; held-out pass@1 after every step, and the steps to each of TARGETS.

--arms runs some of them (the keys of the others are nan). Top-level keys (medians over
seeds): tool_success_delta, cod_position_slope, cod_shuffled_slope, trace_mixed_ratio (TRACE's
mixed sets per sampled token over root-only's); trace_earlier counts, per target, the seeds
where TRACE got there in fewer, the same or more steps. --trace-advantage picks both TRACE
arms' estimator (trace: one advantage per sample; trace_tree: per turn, from the tree).
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
from rollwise.presets import PRESETS
from rollwise.report.data import read_metrics
from rollwise.tasks import load_task
from rollwise.training import sft

DEFAULTS = ["run.log=quiet", "run.report=false", "run.tensorboard=false"]
CONFIGS = PRESETS
CALC, PACKS = str(CONFIGS / "calc.yaml"), str(CONFIGS / "packs.yaml")
CHAIN3 = str(CONFIGS / "chain3.yaml")
TOOL_STEPS, COD_STEPS, TRACE_STEPS = 30, 40, 20
TARGETS = (0.7, 0.75, 0.8)  # held-out pass@1 levels the TRACE arms are timed to
ARMS = ("tool", "cod", "trace")


def warm_start(config: str, base: list[str], log) -> str:
    cfg = load_config(config, base + ["run.seed=0"])
    task = load_task(cfg.task)
    sft.warm_start(cfg, task, log=log)
    return str(sft.warm_start_path(cfg, task))


def run(config: str, overrides: list[str]) -> list[dict]:
    """The run's metrics rows (evaluations included)."""
    summary = train(load_config(config, overrides))
    return read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")


def evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/pass1" in r]


def first_and_last(config: str, base: list[str], init: str, seed: int, name: str,
                   steps: int, evaluations: int) -> tuple[dict, dict]:
    """The first and last evaluation of an RL run from the warm start `init`."""
    rows = evals(run(config, base + [
        f"run.init={init}", f"run.seed={seed}", f"run.name={name}-seed{seed}",
        f"train.steps={steps}", f"run.eval_every={max(1, steps // evaluations)}"]))
    return rows[0], rows[-1]


def tool_arm(base: list[str], init: str, seed: int) -> dict:
    first, last = first_and_last(CALC, base, init, seed, "tool", TOOL_STEPS, 3)
    return {"start": first["eval/pass1"], "end": last["eval/pass1"],
            "delta": last["eval/pass1"] - first["eval/pass1"],
            "tool_use_start": first["eval/tool_use"], "tool_use_end": last["eval/tool_use"],
            "mul3_end": last["eval/pass1/mul3"],
            "mul3_without_tool_end": last["eval/solved_without_tool/mul3"]}


def cod_arm(base: list[str], init: str, seed: int) -> dict:
    first, last = first_and_last(PACKS, base, init, seed, "cod", COD_STEPS, 2)
    return {"slope_start": first["eval/position_slope"], "slope": last["eval/position_slope"],
            "shuffled_slope": last["eval/shuffled_slope"], "pass1_start": first["eval/pass1"],
            "pass1": last["eval/pass1"], "shuffled_pass1": last["eval/shuffled_pass1"],
            "by_position": [last[f"eval/pass1/pos{i}"] for i in range(8)]}


def trace_arm(config: str, base: list[str], init: str, seed: int, allocation: str,
              advantage: str) -> dict:
    rows = run(config, base + [
        f"run.init={init}", f"run.seed={seed}", f"run.name=trace-{allocation}-seed{seed}",
        "generate.strategy=trace", f"generate.trace.allocation={allocation}",
        f"train.advantage={advantage}", f"train.steps={TRACE_STEPS}", "run.eval_every=1"])
    steps = [r for r in rows if "tokens/generated" in r]
    tokens = sum(r["tokens/generated"] for r in steps)
    mixed = sum(r.get("decisions/trace/siblings/mixed", 0) for r in steps)
    sets = sum(r.get("decisions/trace/siblings/sets", 0) for r in steps)
    curve = [(r["step"], r["eval/pass1"]) for r in evals(rows)]
    return {"sampled_tokens": tokens, "sibling_sets": sets, "mixed_sets": mixed,
            "mixed_per_1k_tokens": 1000 * mixed / max(tokens, 1),
            "steps_to": {str(t): steps_to(curve, t) for t in TARGETS},
            "mean_pass1": statistics.mean(p for _, p in curve[1:]),
            "final": curve[-1][1], "curve": [p for _, p in curve]}


def trace_arms(config: str, base: list[str], init: str, seed: int, advantage: str) -> dict:
    """TRACE's allocation and root-only's from one warm start, both trained with `advantage`,
    and their mixed-set ratio."""
    arms = {a: trace_arm(config, base, init, seed, a, advantage) for a in ("trace", "root")}
    arms["ratio"] = ratio(arms["trace"]["mixed_per_1k_tokens"],
                          arms["root"]["mixed_per_1k_tokens"])
    return arms


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step whose held-out pass@1 reaches the target (None: never)."""
    return next((step for step, p in curve if reaches(p, target)), None)


def earlier(trace: list[dict], target: str) -> dict[str, int]:
    """Seeds where TRACE reached the target in fewer steps than root-only, in as many, or in
    more (a target never reached counts as later than any step)."""
    def at(arm: dict) -> float:
        n = arm["steps_to"][target]
        return math.inf if n is None else n
    pairs = [(at(t["trace"]), at(t["root"])) for t in trace]
    return {"fewer": sum(a < b for a, b in pairs), "same": sum(a == b for a, b in pairs),
            "more": sum(a > b for a, b in pairs)}


def ratio(a: float, b: float) -> float:
    """a / b; with b = 0, inf when a > 0 and nan when both are 0 (nothing to compare)."""
    return a / b if b else (math.inf if a else math.nan)


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else math.nan


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench agents", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--trace-config", default=CHAIN3, help="the TRACE arms' task")
    p.add_argument("--trace-advantage", default="trace_tree", choices=("trace", "trace_tree"),
                   help="both TRACE arms' estimator: trace (sibling baselines per sample) or "
                        "trace_tree (per-turn credit from the whole tree)")
    p.add_argument("--root", default="runs/bench-agents")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    base = [*DEFAULTS, *args.overrides, f"run.root={args.root}"]
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    inits = {arm: warm_start(config, base, log) for arm, config in
             (("tool", CALC), ("cod", PACKS), ("trace", args.trace_config)) if arm in args.arms}
    tool, cod, trace = [], [], []
    for seed in args.seeds:
        if "tool" in inits:
            tool.append(tool_arm(base, inits["tool"], seed))
            log(f"seed {seed}: tool {tool[-1]['start']:.3f} -> {tool[-1]['end']:.3f}")
        if "cod" in inits:
            cod.append(cod_arm(base, inits["cod"], seed))
            log(f"seed {seed}: cod slope {cod[-1]['slope']:.3f} (shuffled "
                f"{cod[-1]['shuffled_slope']:.3f})")
        if "trace" in inits:
            trace.append(trace_arms(args.trace_config, base, inits["trace"], seed,
                                    args.trace_advantage))
            log(f"seed {seed}: trace mixed ratio {trace[-1]['ratio']:.2f}")
    out = {
        "tool_success_delta": median([t["delta"] for t in tool]),
        "cod_position_slope": median([c["slope"] for c in cod]),
        "cod_shuffled_slope": median([c["shuffled_slope"] for c in cod]),
        "trace_mixed_ratio": median([t["ratio"] for t in trace]),
        "trace_steps_to": {a: {str(k): median([t[a]["steps_to"][str(k)] for t in trace])
                               for k in TARGETS} for a in ("trace", "root")},
        "trace_reached": {a: {str(k): sum(t[a]["steps_to"][str(k)] is not None for t in trace)
                              for k in TARGETS} for a in ("trace", "root")},
        "trace_mean_pass1": {a: median([t[a]["mean_pass1"] for t in trace])
                             for a in ("trace", "root")},
        "trace_earlier": {str(k): earlier(trace, str(k)) for k in TARGETS},
        "trace_config": args.trace_config, "trace_advantage": args.trace_advantage,
        "seeds": args.seeds,
        "runs": {"tool": tool, "cod": cod, "trace": trace},
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(markdown(out))
    return 0


def markdown(out: dict) -> str:
    runs = out["runs"]
    lines = ["| seed | tool pass@1 start → end | mul3 end (without a call) "
             "| CoD slope start → end "
             "| shuffled | TRACE mixed / 1k tok | root | TRACE steps to "
             + " / ".join(map(str, TARGETS)) + " | root |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, seed in enumerate(out["seeds"]):
        t, c, tr = (runs[a][i] if runs[a] else None for a in ARMS)
        cells = [str(seed)]
        cells += [f"{t['start']:.3f} → {t['end']:.3f}", f"{t['mul3_end']:.3f} "
                  f"({t['mul3_without_tool_end']:.3f})"] if t else ["–"] * 2
        cells += [f"{c['slope_start']:.3f} → {c['slope']:.3f}",
                  f"{c['shuffled_slope']:.3f}"] if c else ["–"] * 2
        cells += [f"{tr['trace']['mixed_per_1k_tokens']:.2f}",
                  f"{tr['root']['mixed_per_1k_tokens']:.2f}", _steps(tr["trace"]),
                  _steps(tr["root"])] if tr else ["–"] * 4
        lines.append("| " + " | ".join(cells) + " |")
    keys = ("tool_success_delta", "cod_position_slope", "cod_shuffled_slope",
            "trace_mixed_ratio")
    return "\n".join(lines + [""] + [f"{k}: {out[k]:.3f}" for k in keys])


def _steps(arm: dict) -> str:
    return " / ".join("–" if n is None else str(n) for n in arm["steps_to"].values())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
