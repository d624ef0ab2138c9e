"""Read `rollwise bench select --progress` logs back: medians at several targets, and how
often three seeds alone would show the issue's DPS target.

    rollwise bench select --readout LOG [LOG ...] [--targets 0.29 0.28 0.27]

Runs split over several invocations (cores, seed ranges) are merged by (method, seed); a
later line for the same pair replaces an earlier one. Each run's curve gives the rollouts at
its first held-out evaluation at or above a target, so lower targets need no new runs.
"""

from __future__ import annotations

import ast
import itertools
import re
import statistics

from rollwise.bench.target import reaches

LINE = re.compile(r"^# (?P<method>\S+) seed (?P<seed>\d+): mixed (?P<mixed>[\d.]+) .* "
                  r"curve (?P<curve>\[.*\])$")
NOT_REACHED = float("inf")
RATIO = 0.30  # the target: DPS needs at most 30 % of dynamic sampling's rollouts


def parse_logs(paths: list[str]) -> dict[tuple[str, int], dict]:
    """(method, seed) -> {"mixed": share, "curve": [(step, rollouts, pass@1), ...]}."""
    runs = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = LINE.match(line.strip())
                if m:
                    runs[(m["method"], int(m["seed"]))] = {
                        "mixed": float(m["mixed"]), "curve": ast.literal_eval(m["curve"])}
    if not runs:
        raise ValueError(f"no '# <method> seed <n>: ... curve [...]' lines in {paths}: pass "
                         "the output of rollwise bench select --progress")
    return runs


def rollouts_to(curve: list, target: float) -> float:
    return next((r for _, r, p in curve if reaches(p, target)), NOT_REACHED)


def medians(runs: dict, target: float, seeds: list[int]) -> dict[str, tuple[float, int]]:
    """method -> (median rollouts to target, seeds reaching it), for methods with every seed."""
    out = {}
    for method in sorted({m for m, _ in runs}):
        if all((method, s) in runs for s in seeds):
            need = [rollouts_to(runs[(method, s)]["curve"], target) for s in seeds]
            out[method] = (statistics.median(need), sum(n < NOT_REACHED for n in need))
    return out


def meets_target(runs: dict, target: float, seeds, ds: str) -> bool:
    """DPS's median <= RATIO x the dynamic-sampling variant's, and below uniform's."""
    med = medians(runs, target, list(seeds))
    dps, base, uni = med["dps"][0], med[ds][0], med["uniform"][0]
    return dps < NOT_REACHED and dps <= RATIO * base and dps < uni


def subset_rate(runs: dict, target: float, ds: str, k: int = 3) -> tuple[int, int]:
    """(k-seed subsets meeting the target, all k-seed subsets) of the seeds that uniform,
    DPS and `ds` all have."""
    seeds = sorted(s for m, s in runs if m == "dps"
                   and ("uniform", s) in runs and (ds, s) in runs)
    subsets = list(itertools.combinations(seeds, k))
    return sum(meets_target(runs, target, c, ds) for c in subsets), len(subsets)


def report(paths: list[str], targets: list[float]) -> str:
    runs = parse_logs(paths)
    seeds = sorted({s for _, s in runs})
    methods = {m for m, _ in runs}
    lines = [f"seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}); a method is shown where it has "
             "all of them", ""]
    for t in targets:
        med = medians(runs, t, seeds)
        cells = ", ".join(f"{m} {_fmt(v)} ({n}/{len(seeds)})" for m, (v, n) in med.items())
        lines.append(f"target {t}: {cells}")
        for ds in ("dynamic", "dynamic-full"):
            if "dps" in med and ds in med and med[ds][0] < NOT_REACHED:
                lines.append(f"  DPS / {ds}: {med['dps'][0] / med[ds][0]:.3f}")
            if {"dps", "uniform", ds} <= methods:
                hit, n = subset_rate(runs, t, ds)
                if n:
                    lines.append(f"  three-seed subsets meeting the target against {ds}: "
                                 f"{hit}/{n} ({hit / n:.0%})")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "not reached" if x == NOT_REACHED else f"{x:.0f}"
