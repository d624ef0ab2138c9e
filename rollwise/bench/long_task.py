"""A long-answer run read back: does the task keep its answers long and its model learning?

    rollwise bench long_task --run runs/<root>/<name> [--last 30] [--json]

From the run's rollout store, per --window steps (10): the responses' median, 0.9 quantile and
mean length in tokens, their ratio, the share cut at generate.max_new_tokens, and the mean
reward; from its
metrics.jsonl, held-out pass@1 at each evaluation (and per tier). The goals of a long-answer
task, checked on them:
- still learning: the least-squares slope of held-out pass@1 over the evaluations of the last
  --last steps is positive by more than its standard error;
- long: the median response is at least 80 tokens in every window;
- variable: the 0.9 quantile is at least 2.5x the median in every window.
For a run warm-started by the worked task's wrong_facts teacher, per window too: of the step
lines whose total and term end in one of the teacher's wrong pairs, the share written the
teacher's way and the share right; and the share of the other lines written wrong (the
model's own slips). RL relearning the facts shows as the teacher's share falling.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from rollwise.config import load_config
from rollwise.store.rollouts import RolloutStore
from rollwise.tasks.arith import wrong_facts
from rollwise.tasks.worked import STEP_LINE, Wrong, slipped_total
from rollwise.types import Status

MIN_MEDIAN, MIN_SPREAD = 80, 2.5


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def length_profile(run_dir: Path, window: int = 1) -> list[dict]:
    """The responses' lengths over each `window` consecutive steps (a step of 8 prompts has
    8 problem sizes: its quantiles follow which were drawn)."""
    store = RolloutStore(run_dir / "rollouts")
    steps = store.steps()
    out = []
    for at in range(0, len(steps), window):
        samples = store.samples(steps[at:at + window])
        lengths = [s.num_tokens for s in samples]
        median = quantile(lengths, 0.5)
        out.append({"step": steps[at], "samples": len(samples), "median": median,
                    "q90": quantile(lengths, 0.9), "mean": statistics.fmean(lengths),
                    "spread": quantile(lengths, 0.9) / max(median, 1),
                    "truncated": sum(s.status == Status.TRUNCATED for s in samples)
                    / len(samples),
                    "reward": statistics.fmean(s.reward for s in samples)})
    return out


def line_kinds(text: str, wrong: Wrong):
    """Each step line of a response by its own arithmetic: 'fact_right', 'fact_teacher' (off
    as the teacher writes it), 'fact_other' for a line on a wrong pair; 'right' or 'wrong'
    for the others."""
    for m in map(STEP_LINE.match, text.splitlines()):
        if not m:
            continue
        a, op, x, c = int(m[1]), m[2], int(m[3]), int(m[4])
        right = a + x if op == "+" else a - x
        off = wrong.get((a % 10, x % 10))
        if off is None:
            yield "right" if c == right else "wrong"
        elif c == right:
            yield "fact_right"
        else:
            yield "fact_teacher" if c == slipped_total(right, off) else "fact_other"


def fact_profile(run_dir: Path, wrong: Wrong, window: int = 1) -> list[dict]:
    """Per `window` steps: the lines on the teacher's wrong pairs, the shares of them written
    its way and right, and the share of the other lines written wrong."""
    store = RolloutStore(run_dir / "rollouts")
    steps, out = store.steps(), []
    for at in range(0, len(steps), window):
        counts = dict.fromkeys(("fact_right", "fact_teacher", "fact_other", "right", "wrong"), 0)
        for text in store.read(steps[at:at + window]).column("response_text").to_pylist():
            for kind in line_kinds(text or "", wrong):
                counts[kind] += 1
        facts = counts["fact_right"] + counts["fact_teacher"] + counts["fact_other"]
        others = counts["right"] + counts["wrong"]
        out.append({"step": steps[at], "fact_lines": facts,
                    "teacher_share": counts["fact_teacher"] / max(facts, 1),
                    "fact_right_share": counts["fact_right"] / max(facts, 1),
                    "other_wrong_share": counts["wrong"] / max(others, 1)})
    return out


def teacher_facts(run_dir: Path) -> Wrong | None:
    """The wrong pairs of the run's warm-start teacher (from its config.yaml), or None."""
    if not (run_dir / "config.yaml").is_file():
        return None
    task = load_config(run_dir / "config.yaml").task
    if task.name != "worked" or task.worked.teacher != "wrong_facts":
        return None
    return wrong_facts(task.worked.wrong_facts, task.seed)


def pass1_series(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a torn last line
            continue
        if "eval/pass1" in m:
            rows.append({"step": m["step"], "pass1": m["eval/pass1"],
                         **{k.split("/", 2)[2]: v for k, v in m.items()
                            if k.startswith("eval/pass1/")}})
    return rows


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of y on x and its standard error (nan with fewer than 3 points)."""
    n = len(points)
    if n < 3:
        return math.nan, math.nan
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    rss = sum((y - my - b * (x - mx)) ** 2 for x, y in points)
    return b, math.sqrt(rss / (n - 2) / sxx)


def goals(profile: list[dict], series: list[dict], last: int) -> dict:
    end = series[-1]["step"] if series else 0
    tail = [(r["step"], r["pass1"]) for r in series if r["step"] >= end - last]
    b, se = slope(tail)
    return {"slope_last": b, "slope_se": se, "slope_points": len(tail),
            "still_learning": bool(b - se > 0) if not math.isnan(b) else False,
            "min_median": min((p["median"] for p in profile), default=0),
            "min_spread": min((p["spread"] for p in profile), default=0),
            "long": all(p["median"] >= MIN_MEDIAN for p in profile) and bool(profile),
            "variable": all(p["spread"] >= MIN_SPREAD for p in profile) and bool(profile)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench long_task", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="a run directory")
    ap.add_argument("--last", type=int, default=30, help="steps of the slope fit")
    ap.add_argument("--window", type=int, default=10,
                    help="steps whose responses make one row of the length profile")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not (args.run / "metrics.jsonl").is_file():
        ap.error(f"{args.run} has no metrics.jsonl: pass a run directory (runs/<root>/<name>)")
    profile, series = length_profile(args.run, args.window), pass1_series(args.run)
    wrong = teacher_facts(args.run)
    facts = fact_profile(args.run, wrong, args.window) if wrong else []
    out = {"benchmark": "long_task", "run": str(args.run), "lengths": profile,
           "facts": facts, "pass1": series, "goals": goals(profile, series, args.last)}
    if args.json:
        print(json.dumps(out))
        return 0
    for p in profile:
        print(f"steps from {p['step']:4d}: median {p['median']:6.1f} q90 {p['q90']:6.1f} "
              f"({p['spread']:.2f}x) truncated {p['truncated']:.1%} reward {p['reward']:.3f}")
    for f in facts:
        print(f"steps from {f['step']:4d}: {f['fact_lines']} lines on the teacher's wrong pairs, "
              f"{f['teacher_share']:.1%} written its way, {f['fact_right_share']:.1%} right; "
              f"other lines wrong {f['other_wrong_share']:.1%}")
    for r in series:
        print(f"eval at step {r['step']}: pass@1 {r['pass1']:.3f}")
    g = out["goals"]
    print(f"slope over the last {args.last} steps: {g['slope_last']:.5f} ± {g['slope_se']:.5f} "
          f"a step ({g['slope_points']} evaluations); still learning: {g['still_learning']}; "
          f"median >= {MIN_MEDIAN}: {g['long']} (lowest {g['min_median']:.0f}); q90 >= "
          f"{MIN_SPREAD}x median: {g['variable']} (lowest {g['min_spread']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
