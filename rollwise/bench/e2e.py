"""End to end against TRL: the same initial model, task, reward, group size, prompts per step,
learning-rate schedule and step budget, trained by rollwise and by TRL's GRPOTrainer (CPU, no
vLLM), one process at a time, for several seeds.

    rollwise bench e2e --vs trl --seeds 0 1 2 --steps 30 --target 0.80 [key=value ...]
    rollwise bench e2e --vs trl --config smollm2 --steps 20 --threads 2 \
        --trl-micro-batch 16 --target 0.5 run.eval_every=5      # SmolLM2-135M-Instruct

The initial model is the config's model.path (a pretrained model) or the tiny model's warm
start. Final pass@1 is also compared seed by seed (rollwise less TRL: mean and standard error).

Reports, as medians over the seeds: training wall time to reach a held-out greedy pass@1
target (evaluation time excluded for both; "not reached" counts as infinite), seconds per
step, and final pass@1. Both are evaluated by rollwise's evaluate() every run.eval_every
steps. The warm start is trained once (run.seed of --warm-seed) and shared by every run.
Each run's metrics.jsonl lands under --root; <root>/report-e2e.html overlays all runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from rollwise import models
from rollwise.bench.e2e_trl import run_trl as trl_train
from rollwise.bench.e2e_trl import trl_precision
from rollwise.bench.target import reaches
from rollwise.config import Config, dump_config, load_config
from rollwise.engine import BuiltinEngine
from rollwise.evaluate import evaluate
from rollwise.loop.run import train
from rollwise.report.report import write_report
from rollwise.stages.filter import eval_scorer
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter
from rollwise.training.sft import warm_start, warm_start_path

DEFAULTS = ["run.eval_every=1", "run.log=quiet"]  # eval every step: exact time to target


def time_to_target(rows: list[dict], target: float, clock: str) -> float:
    """Training seconds at the first evaluation with pass@1 >= target; inf if none."""
    for r in rows:
        if reaches(r.get("eval/pass1", -1.0), target):
            return float(r[clock])
    return math.inf


def rollwise_clock(rows: list[dict]) -> list[dict]:
    """Add train_seconds (cumulative perf/step_seconds: evaluation excluded) to the rows."""
    total, out = 0.0, []
    for r in rows:
        total += float(r.get("perf/step_seconds", 0.0))
        out.append({**r, "train_seconds": total})
    return out


def summarize(framework: str, seed: int, rows: list[dict], target: float) -> dict:
    steps = [r for r in rows if r.get("step", 0) >= 1]
    evals = [r for r in rows if "eval/pass1" in r]
    return {"framework": framework, "seed": seed,
            "seconds_to_target": time_to_target(rows, target, "train_seconds"),
            "steps_to_target": next((r["step"] for r in evals
                                     if reaches(r["eval/pass1"], target)), None),
            "seconds_per_step": rows[-1]["train_seconds"] / max(len(steps), 1),
            "pass1_start": evals[0]["eval/pass1"], "pass1_final": evals[-1]["eval/pass1"],
            "pass1_best": max(r["eval/pass1"] for r in evals), "steps": len(steps),
            "train_seconds": rows[-1]["train_seconds"],
            "curve": [(r["step"], r["train_seconds"], r["eval/pass1"]) for r in evals]}


def warm_model(cfg: Config, log) -> Path:
    """The shared initial model's folder: model.path (a pretrained model), or the cached warm
    start of the tiny model, trained first when it is not cached."""
    if cfg.model.path:
        return Path(models.resolve_path(cfg.model.path))
    task = load_task(cfg.task)
    warm_start(cfg, task, log=log)
    return warm_start_path(cfg, task)


def run_rollwise(cfg: Config, target: float) -> dict:
    summary = train(cfg)
    rows = [json.loads(x) for x in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    return summarize("rollwise", cfg.run.seed, rollwise_clock(rows), target)


def run_trl(cfg: Config, warm: Path, target: float, log, micro_batch: int | None = None
            ) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    task = load_task(cfg.task)
    tok = models.load_tokenizer(warm)
    scorer = eval_scorer(cfg.filter, task)  # what the rollwise run's evaluation uses
    generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(warm)))
    prompter = Prompter(cfg.task, tok, plain_task=bool(getattr(task, "plain_prompts", False)),
                        model_config=generation)  # as Prompter.for_task, from the folder

    def eval_fn(model):  # the same held-out greedy pass@1 as rollwise's loop
        # A fresh copy: accelerate wraps the instance's forward in a closure over the
        # original model, which a deepcopy would keep calling.
        clone = AutoModelForCausalLM.from_config(copy.deepcopy(model.config))
        clone.load_state_dict(model.state_dict())
        engine = BuiltinEngine(clone.eval(), max_batch=cfg.engine.max_batch,
                        copy_model=False)
        return evaluate(engine, prompter, task.eval, scorer, cfg.generate.max_new_tokens)
    out_dir = Path(cfg.run.root) / cfg.run.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(dump_config(cfg))
    threads = torch.get_num_threads()
    if cfg.run.threads:  # the same torch threads as rollwise's Run uses
        torch.set_num_threads(cfg.run.threads)
    try:
        result = trl_train(cfg, task, warm, out_dir, eval_fn, prompter, log=log,
                           micro_batch=micro_batch)
    finally:
        torch.set_num_threads(threads)
    return summarize("trl", cfg.run.seed, result["rows"], target)


def brief(result: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in result.items() if k != "curve")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def table(results: list[dict], target: float) -> str:
    def fmt_s(x):
        return "not reached" if math.isinf(x) else f"{x:.0f}"
    lines = [f"| framework | seed | s to pass@1 ≥ {target:.2f} | steps to target | s / step | "
             "pass@1 start | pass@1 final | pass@1 best |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['framework']} | {r['seed']} | {fmt_s(r['seconds_to_target'])} | "
                     f"{r['steps_to_target'] or '–'} | {r['seconds_per_step']:.2f} | "
                     f"{r['pass1_start']:.3f} | {r['pass1_final']:.3f} | {r['pass1_best']:.3f} |")
    meds = medians(results)
    for fw, m in meds.items():
        lines.append(f"| **{fw} median** | | {fmt_s(m['seconds_to_target'])} | | "
                     f"{m['seconds_per_step']:.2f} | {m['pass1_start']:.3f} | "
                     f"{m['pass1_final']:.3f} | {m['pass1_best']:.3f} |")
    if {"rollwise", "trl"} <= set(meds):
        a, b = meds["rollwise"], meds["trl"]
        ta, tb = a["seconds_to_target"], b["seconds_to_target"]
        ratio = ("TRL did not reach it" if math.isinf(tb) else
                 "rollwise did not reach it" if math.isinf(ta) else f"{ta / tb:.2f}x")
        lines.append(f"\nrollwise / TRL (medians): time to target {ratio}, time per step "
                     f"{a['seconds_per_step'] / b['seconds_per_step']:.2f}x, final pass@1 "
                     f"{a['pass1_final']:.3f} vs {b['pass1_final']:.3f}")
        d = paired_final_diff(results)
        if d is not None:
            lines.append(f"final pass@1, rollwise - TRL, paired by seed: {d['mean']:+.3f} ± "
                         f"{d['se']:.3f} (mean ± standard error over {d['seeds']} seeds; "
                         f"{', '.join(f'{x:+.3f}' for x in d['diffs'])})")
    return "\n".join(lines)


def paired_final_diff(results: list[dict]) -> dict | None:
    """rollwise's final pass@1 less TRL's, seed by seed: the differences, their mean and
    standard error (None without a seed run by both)."""
    final = {(r["framework"], r["seed"]): r["pass1_final"] for r in results}
    diffs = [final[("rollwise", s)] - final[("trl", s)] for fw, s in final
             if fw == "rollwise" and ("trl", s) in final]
    if not diffs:
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return {"diffs": diffs, "mean": statistics.fmean(diffs), "se": se, "seeds": len(diffs)}


def levels_table(results: list[dict], levels: list[float]) -> str:
    """Median training seconds (and steps) to reach each pass@1 level, per framework."""
    lines = ["| framework | " + " | ".join(f"s (steps) to pass@1 ≥ {x:.2f}" for x in levels)
             + " |", "|---|" + "---|" * len(levels)]
    for fw in dict.fromkeys(r["framework"] for r in results):
        cells = []
        for x in levels:
            reach = [next(((s, t) for s, t, p in r["curve"] if reaches(p, x)), None)
                     for r in results if r["framework"] == fw]
            secs = median([math.inf if c is None else c[1] for c in reach])
            steps = median([math.inf if c is None else c[0] for c in reach])
            cells.append("not reached" if math.isinf(secs) else f"{secs:.0f} ({steps:g})")
        lines.append(f"| {fw} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def medians(results: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for fw in dict.fromkeys(r["framework"] for r in results):
        rs = [r for r in results if r["framework"] == fw]
        out[fw] = {k: median([r[k] for r in rs]) for k in (
            "seconds_to_target", "seconds_per_step", "pass1_start", "pass1_final", "pass1_best")}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vs", choices=["trl", "none"], default="trl",
                   help="the framework to compare with ('none': rollwise only)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30, help="RL steps for both (train.steps)")
    p.add_argument("--target", type=float, default=0.80, help="held-out pass@1 target")
    p.add_argument("--also", type=float, nargs="*", default=[0.70, 0.85],
                   help="more pass@1 levels for the time-to-reach table")
    p.add_argument("--warm-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for both (1 suits a shared 2-core machine)")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="completions per TRL forward/backward (gradients accumulate to the "
                        "same update; bounds TRL's memory on a real model's vocabulary); "
                        "default train.micro_batch_size")
    p.add_argument("--config")
    p.add_argument("--root", default="runs/bench-e2e")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    if args.vs == "trl":
        _require_trl()
    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    base = [*DEFAULTS, f"run.threads={args.threads}", *args.overrides,
            f"train.steps={args.steps}", f"run.root={args.root}"]
    warm_cfg = load_config(args.config, [*base, f"run.seed={args.warm_seed}"])
    if args.vs == "trl":
        trl_precision(warm_cfg)  # a precision TRL cannot match stops here, before any run
    warm = warm_model(warm_cfg, log)
    log(f"shared warm start: {warm}")
    results, t0 = [], time.time()
    for seed in args.seeds:
        common = [*base, f"run.seed={seed}", f"run.init={warm}"]
        cfg = load_config(args.config, [*common, f"run.name=rollwise-seed{seed}"])
        results.append(run_rollwise(cfg, args.target))
        log(f"rollwise seed {seed}: {brief(results[-1])}")
        if args.vs == "trl":
            cfg = load_config(args.config, [*common, f"run.name=trl-seed{seed}"])
            results.append(run_trl(cfg, warm, args.target, log, args.trl_micro_batch))
            log(f"trl seed {seed}: {brief(results[-1])}")
    log(f"benchmark wall time {time.time() - t0:.0f}s")
    dirs = [Path(args.root) / f"{r['framework']}-seed{r['seed']}" for r in results]
    log(f"curves overlaid: {write_report(dirs, Path(args.root) / 'report-e2e.html')}")
    if args.json:
        def finite(x):
            return None if isinstance(x, float) and math.isinf(x) else x
        out = {"target": args.target, "steps": args.steps, "seeds": args.seeds,
               "results": [{k: finite(v) for k, v in r.items()} for r in results],
               "medians": {fw: {k: finite(v) for k, v in m.items()}
                           for fw, m in medians(results).items()},
               "paired_final_pass1_diff": paired_final_diff(results)}
        print(json.dumps(out, indent=2))  # "not reached" is null
    else:
        print(table(results, args.target))
        print()
        print(levels_table(results, sorted({args.target, *args.also})))
    return 0


def _require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("rollwise bench e2e --vs trl needs TRL: pip install 'rollwise[trl]' "
                         "(trl, datasets, accelerate)") from None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
