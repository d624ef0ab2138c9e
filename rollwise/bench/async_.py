"""Asynchronous training against synchronous on this CPU (`rollwise bench async`).

    rollwise bench async [--seeds 0 1 2] [--steps 40] [--eval-every 5] [--target 0.8] [--json]

Arms, one after another (each has the machine to itself), from the same warm start (the
default config's SFT) and seeds:
- sync: the synchronous loop, engine in this process, torch's default threads;
- async1, async2: loop.mode=async with max_staleness 1 and 2, the engine in a child process
  (sync.transport=process), so generation and training each have a core (one thread each),
  and the correction of stale() below: truncated importance weights, the PPO ratio anchored at
  the sampling version (eta snapshots kept), VCPO's ESS-scaled learning rate;
- ray2: loop.backend=ray with 2 rollout workers, asynchronous at max_staleness 1, the same
  correction;
- alone1: async1's settings in the synchronous loop: generation and training each with one
  core to themselves, never side by side.

Per arm and seed: trained tokens per second over the run (evaluation excluded), seconds to the
held-out greedy pass@1 target (evaluation excluded), final pass@1. Every arm uses sparse sync,
so its first push (full) and later ones (sparse) fit the sync-time model below.

Cost model: generation, training and sync times per step, fitted to the sync arm (and the Ray
arm's per-step overhead), give the throughput of W = 1..64 rollout workers, synchronous
(gen/W + train + sync) and asynchronous (max(gen/W, train + sync)), with full and sparse sync;
plotted into <root>/async_report.html beside the arms' curves.

Top-level JSON keys: async_speedup (async1's median tokens per second over sync's),
async_pass1_delta (async1's final pass@1 minus sync's, mean over seeds), and beside them
sync_pass1_sd (the seed standard deviation of sync's final pass@1: the noise the delta is
measured against), and async_ceiling (sync's seconds per step over the slower side's in
alone1: the most any overlap of generation and training could gain on this machine).
"""

from __future__ import annotations

import argparse
import html
import json
import statistics
import sys
import time
from pathlib import Path

from rollwise.bench.jobs import BENCH_RUN, execute, print_keys_and_failures, warm_start_folder
from rollwise.bench.target import reaches
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.ray_cluster import shutdown
from rollwise.report.plots import figure
from rollwise.report.report import figure_html, write_report


def stale(eta: int) -> list[str]:
    """The correction for tokens up to eta versions old. At this learning rate a step moves
    the policy by several nats on some tokens; without a correction one step of staleness
    undoes the learning. Truncated importance weights (TIS) on the behaviour ratio, the PPO
    ratio anchored at the sampling version's weights (kept as eta snapshots, so the clip
    bounds each token's move from the policy that sampled it), and VCPO's learning rate
    scaled by the batch's effective sample size: each alone leaves a gap in final pass@1,
    the three together none at eta = 1 (BENCHMARKS.md)."""
    return ["train.correction.mode=tis", "train.correction.vcpo_lr=true",
            "train.correction.anchor=version", f"train.correction.snapshots={eta}",
            "run.threads=1"]


ARMS = {
    "sync": [],
    "async1": ["loop.mode=async", "loop.max_staleness=1", "sync.transport=process", *stale(1)],
    "async2": ["loop.mode=async", "loop.max_staleness=2", "sync.transport=process", *stale(2)],
    "ray2": ["loop.mode=async", "loop.max_staleness=1", "loop.backend=ray",
             "loop.rollout_workers=2", *stale(1)],
    # async1's settings run synchronously: each side's time per step with a core to itself,
    # the most an overlap of the two could achieve (async_ceiling)
    "alone1": ["sync.transport=process", *stale(1)],
}
WORKERS = [1, 2, 4, 8, 16, 32, 64]


def run_arm(arm: str, seed: int, init: str, root: str, steps: int, eval_every: int,
            target: float, extra: list[str]) -> dict:
    name = f"{arm}-s{seed}"
    cfg = load_config(None, BENCH_RUN + [
        f"run.init={init}", f"run.root={root}", f"run.name={name}", f"run.seed={seed}",
        f"train.steps={steps}", f"run.eval_every={eval_every}", "run.checkpoint_every=0",
        "sync.mode=sparse", "run.tensorboard=false"] + ARMS[arm] + extra)
    try:
        summary = train(cfg)
    finally:
        if arm.startswith("ray"):
            shutdown()
    rows = [json.loads(line) for line in open(Path(root) / name / "metrics.jsonl")]
    return {"arm": arm, "seed": seed, **measure(rows, target),
            "pass1_start": summary["eval_pass1_start"], "pass1_end": summary["eval_pass1_end"]}


def measure(rows: list[dict], target: float) -> dict:
    """Throughput and time to target from a run's metrics rows, evaluation time excluded."""
    eval_so_far, clock, reached = 0.0, [], None
    for m in rows:
        eval_so_far += m.get("perf/eval_seconds", 0.0)
        clock.append(m["wall_seconds"] - eval_so_far)
        if reached is None and reaches(m.get("eval/pass1", -1), target) and m["step"] > 0:
            reached = clock[-1] - clock[0]
    steps = [m for m in rows if m["step"] > 0]
    seconds = clock[-1] - clock[0]
    tokens = sum(m.get("train/tokens", 0.0) for m in steps)
    syncs = [(m["sync/bytes"], m["sync/seconds"], m["sync/sparse"]) for m in steps]
    return {"seconds": seconds, "tokens_trained": tokens, "tokens_per_s": tokens / seconds,
            "seconds_to_target": reached, "reached": reached is not None,
            "gen_s": statistics.median(m["perf/gen_seconds"] for m in steps),
            "train_s": statistics.median(m["perf/train_seconds"] for m in steps),
            "tokens_per_step": tokens / len(steps),
            "full_bytes": steps[0]["sync/full_bytes"], "syncs": syncs,
            "staleness_max": max(m.get("staleness/max", 0) for m in steps),
            "wait_s": sum(m.get("perf/wait_seconds", 0.0) for m in steps)}


# ---- the cost model ----------------------------------------------------------------------------

def fit_cost_model(results: list[dict]) -> dict:
    """Per-step generation and training seconds (medians of the sync arm), sync seconds per
    byte (least squares through the origin over every push of the sync arm: the first is
    full, the rest sparse), and the Ray arm's per-step overhead over an even split of
    generation."""
    sync = [r for r in results if r["arm"] == "sync"]
    gen = statistics.median(r["gen_s"] for r in sync)
    train = statistics.median(r["train_s"] for r in sync)
    b = _per_byte([(b, s) for r in sync for b, s, _ in r["syncs"]])
    sparse = statistics.median(b_ for r in sync for b_, _, sp in r["syncs"] if sp) if any(
        sp for r in sync for *_, sp in r["syncs"]) else None
    ray = [r for r in results if r["arm"] == "ray2"]
    overhead = max(0.0, statistics.median(r["gen_s"] for r in ray) - gen / 2) if ray else 0.0
    return {"gen_s": gen, "train_s": train, "sync_s_per_byte": b,
            "full_bytes": sync[0]["full_bytes"], "sparse_bytes": sparse,
            "worker_overhead_s": overhead,
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in sync)}


def _per_byte(points: list[tuple[float, float]]) -> float:
    """Least-squares slope through the origin of seconds against bytes."""
    return sum(x * y for x, y in points) / max(sum(x * x for x, _ in points), 1e-30)


def simulate(model: dict, workers: list[int] = WORKERS) -> dict[str, list[float]]:
    """Trained tokens per second against rollout workers, sync and async, full and sparse."""
    out = {}
    for kind in ("full", "sparse"):
        nbytes = model["full_bytes"] if kind == "full" else (model["sparse_bytes"]
                                                            or model["full_bytes"])
        push = model["sync_s_per_byte"] * nbytes
        for loop in ("sync", "async"):
            tps = []
            for w in workers:
                gen = model["gen_s"] / w + (model["worker_overhead_s"] if w > 1 else 0.0)
                step = gen + model["train_s"] + push if loop == "sync" else max(
                    gen, model["train_s"] + push)
                tps.append(model["tokens_per_step"] / step)
            out[f"{loop}/{kind}"] = tps
    return out


def cost_model_html(model: dict, curves: dict[str, list[float]]) -> str:

    fig, (ax,) = figure(1, 1, height=3.6)
    for name, ys in curves.items():
        ax.plot(WORKERS, ys, marker="o", label=name, linestyle="-" if "full" in name else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout workers")
    ax.set_ylabel("trained tokens / s (model)")
    ax.legend(fontsize=8)
    note = (f"Fitted per step: generation {model['gen_s']:.3f} s on one worker, training "
            f"{model['train_s']:.3f} s, sync {model['sync_s_per_byte'] * 1e9:.2f} ns/byte "
            f"(full {model['full_bytes']:.0f} B, sparse "
            f"{model['sparse_bytes'] or 0:.0f} B), worker overhead "
            f"{model['worker_overhead_s'] * 1e3:.1f} ms per step. Asynchronous throughput "
            f"stops at the trainer's rate once generation is spread thin enough.")
    return (f"<h2>Cost model: throughput against rollout workers</h2><p class='note'>"
            f"{html.escape(note)}</p>" + figure_html(fig, "cost model"))


# ---- the table -------------------------------------------------------------------------------

def summarize(results: list[dict]) -> dict:
    by = {a: [r for r in results if r["arm"] == a] for a in ARMS}
    arms = {}
    for a, rs in by.items():
        if rs:
            arms[a] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                       "seconds_to_target": statistics.median(
                           r["seconds_to_target"] if r["reached"] else r["seconds"]
                           for r in rs),
                       "reached": sum(r["reached"] for r in rs), "runs": len(rs),
                       "pass1_end": statistics.fmean(r["pass1_end"] for r in rs),
                       "pass1_sd": statistics.stdev(r["pass1_end"] for r in rs)
                       if len(rs) > 1 else None,
                       "staleness_max": max(r["staleness_max"] for r in rs)}
    out = {"arms": arms}
    if "sync" in arms and "async1" in arms and arms["sync"]["tokens_per_s"] > 0:
        out["async_speedup"] = arms["async1"]["tokens_per_s"] / arms["sync"]["tokens_per_s"]
        seeds = sorted({r["seed"] for r in by["sync"]} & {r["seed"] for r in by["async1"]})
        end = {(r["arm"], r["seed"]): r["pass1_end"] for r in results}
        out["async_pass1_delta"] = statistics.fmean(end["async1", s] - end["sync", s]
                                                    for s in seeds)
        out["sync_pass1_sd"] = arms["sync"]["pass1_sd"]
    if by["sync"] and by["alone1"]:
        out["async_ceiling"] = overlap_ceiling(by["sync"], by["alone1"])
    return out


def overlap_ceiling(sync: list[dict], alone: list[dict]) -> float:
    """The largest async_speedup this machine allows with async1's settings: sync's step
    (generation then training, each on every core) over the slower of the two sides when each
    has one core to itself and nothing runs beside it (medians over seeds). Asynchrony only
    overlaps the sides; it cannot make either faster than it runs alone."""
    step = statistics.median(r["gen_s"] + r["train_s"] for r in sync)
    return step / max(statistics.median(r["gen_s"] for r in alone),
                      statistics.median(r["train_s"] for r in alone))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench async", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--init", default=None, help="warm-start model folder (default: the "
                   "default config's SFT, trained and cached)")
    p.add_argument("--root", default="runs/bench-async")
    p.add_argument("--json", action="store_true")
    p.add_argument("--replot", action="store_true", help="no runs: summarize, fit and plot "
                   "the runs already in <root>/runs.jsonl")
    p.add_argument("overrides", nargs="*", help="key=value for every arm")
    a = p.parse_args(argv)
    t0, log = time.time(), Path(a.root) / "runs.jsonl"
    if a.replot:
        results = [json.loads(line) for line in log.read_text().splitlines()]
        failed = [r for r in results if "error" in r]
        results = [r for r in results if "error" not in r]
    else:
        init = a.init or warm_start_folder(None, BENCH_RUN + a.overrides, a.root)
        jobs = [(arm, s, init, a.root, a.steps, a.eval_every, a.target, a.overrides)
                for s in a.seeds for arm in a.arms]
        results, failed = execute(run_arm, jobs, 1, log, lambda j: {"arm": j[0], "seed": j[1]})
    out = summarize(results) if results else {"arms": {}}
    if any(r["arm"] == "sync" for r in results):
        model = fit_cost_model(results)
        curves = simulate(model)
        out["cost_model"] = {**model, "workers": WORKERS, "tokens_per_s": curves}
        dirs = [Path(a.root) / f"{r['arm']}-s{r['seed']}" for r in results if r["seed"] ==
                a.seeds[0]]
        out["report"] = str(write_report(dirs, Path(a.root) / "async_report.html",
                                         [cost_model_html(model, curves)]))
    out["wall_seconds"] = time.time() - t0
    for arm, m in out["arms"].items():
        print(f"{arm:8s} tokens/s {m['tokens_per_s']:8.0f}  s-to-target "
              f"{m['seconds_to_target']:7.1f} (reached {m['reached']}/{m['runs']})  "
              f"pass@1 end {m['pass1_end']:.3f}"
              + (f" (sd {m['pass1_sd']:.3f})" if m["pass1_sd"] is not None else "")
              + f"  staleness max {m['staleness_max']}")
    if a.json:
        print(json.dumps({**out, "runs": results}, indent=1, default=str))
    keys = ("async_speedup", "async_ceiling", "async_pass1_delta")
    return print_keys_and_failures(out, keys, failed, lambda r: r["arm"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
