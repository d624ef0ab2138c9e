"""LoRA against full fine-tuning on one config: the update's speed and memory, what a sync
and a checkpoint weigh, and learning (time to a held-out target, final pass@1) over seeds.

    rollwise bench lora --config smollm2 --seeds 0 1 2 --steps 20 \
        --rank 4 --targets all-linear --target 0.45 --json lora.json

Mechanics, one fresh process per arm (so peak memory is the arm's own): one real step's
groups are generated with the config once, then each arm trains those same groups once to
warm up and --repeats times timed (median seconds), with no engine in the process yet.
Reported: update tokens/s (prompt and response tokens of the trained samples per second of
update), peak resident memory (and its rise over the loaded model: what training adds),
optimizer-state and checkpoint bytes; then an engine is built and the bytes of a sync after
an update are measured. For LoRA also: the engine's merge of
the adapters per sync, and decoding with the adapters merged against decoding through
peft's unmerged low-rank layers, on the same requests.

Learning: a learning-rate sweep per arm (seed 0, --sweep-steps steps; the rate with the
best mean held-out pass@1 over the evaluations after step 0 wins), then --seeds runs per arm
at the winning rate, each `rollwise train` in its own process, one at a time. Time to target:
training seconds (evaluations excluded) to the first evaluation at or above --target.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from rollwise import models
from rollwise.bench.e2e import rollwise_clock, summarize
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
from rollwise.sync import build_sync
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter
from rollwise.training.trainer import Trainer

QUIET = ["run.log=quiet", "run.report=false", "run.tensorboard=false"]


def lora_overrides(args) -> list[str]:
    return [f"train.lora.rank={args.rank}", f"train.lora.targets={args.targets}"]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(optimizer) -> int:
    return sum(nbytes(s.values()) for s in optimizer.state.values())


def checkpoint_bytes(trainer) -> int:
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    return buf.tell()


def make_groups(args) -> dict:
    """One real step's trained groups under the config, pickled for both arms."""
    cfg = load_config(args.config, [*args.overrides, *QUIET, f"run.root={args.root}",
                                    "run.name=mechanics-groups", "run.eval_every=100000"])
    with Run(cfg, Progress("quiet", cfg.train.steps)) as run:
        groups = run.produce(1).trained
    path = Path(args.root) / "mechanics-groups.pt"
    torch.save(groups, path)
    return {"groups": str(path), "samples": sum(len(g.samples) for g in groups)}


def measure_arm(args, arm: str) -> dict:
    """One arm's mechanics, in this process (see the module docstring). The updates run
    first, with no engine yet, so the peak memory they report is the trainer's."""
    extra = lora_overrides(args) if arm == "lora" else []
    cfg = load_config(args.config, [*args.overrides, *extra])
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    groups = torch.load(Path(args.root) / "mechanics-groups.pt", weights_only=False)
    samples = [s for g in groups for s in g.samples]
    tokens = sum(len(s.prompt_ids) + s.num_tokens for s in samples)
    model, tok = models.load_model(cfg.model.path, cfg.model.dtype)
    rss_model = peak_rss()
    trainer = Trainer(model, cfg.train, pad_id=tok.pad_token_id, seed=cfg.run.seed)
    trainer.update(copy.deepcopy(groups))  # warm-up: the packing check, first allocations
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        trainer.update(copy.deepcopy(groups))
        seconds.append(time.perf_counter() - t0)
    out = {"arm": arm, "samples": len(samples), "tokens": tokens, "update_seconds": seconds,
           "update_tokens_per_s": tokens / statistics.median(seconds),
           "trainable_params": sum(p.numel() for p in trainer.params()),
           "optimizer_bytes": optimizer_bytes(trainer.optimizer),
           "checkpoint_bytes": checkpoint_bytes(trainer),
           "peak_rss_bytes": peak_rss(), "peak_rss_over_model_bytes": peak_rss() - rss_model}
    engine = BuiltinEngine(models.load_model(cfg.model.path, cfg.model.dtype)[0],
                           copy_model=False)  # the base weights, as a run's engine has them
    sync = build_sync(cfg.sync, trainer, engine)
    sync.push()  # the first one is always full (of the adapters, with LoRA)
    trainer.update(copy.deepcopy(groups))
    pushed = sync.push()
    out.update(sync_bytes=pushed["sync/bytes"], sync_seconds=pushed["sync/seconds"])
    if arm == "lora":
        out.update(merge_and_decode(trainer, engine, cfg, tok, args))
    return out


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def merge_and_decode(trainer, engine, cfg, tok, args) -> dict:
    """The engine's merge per sync, and decoding with merged weights against decoding through
    peft's unmerged layers (the same requests and seeds)."""
    merges = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.adapters.merge()
        merges.append(time.perf_counter() - t0)
    unmerged = BuiltinEngine(trainer.model.get_base_model())  # peft's layers, copied
    task = load_task(cfg.task)
    prompter = Prompter.for_task(cfg.task, tok, task)
    ids = [prompter.ids(p) for p in task.eval[:args.decode_requests]]
    reqs = [Request(x, SamplingParams(max_new_tokens=args.decode_tokens, temperature=1.0,
                                      seed=i), i) for i, x in enumerate(ids)]
    rates = {"merged": [], "unmerged": []}
    for _ in range(2):  # alternated, so drift on the machine hits both
        for name, e in (("merged", engine), ("unmerged", unmerged)):
            t0 = time.perf_counter()
            done = e.generate(reqs)
            rates[name].append(sum(len(c.token_ids) for c in done) /
                               (time.perf_counter() - t0))
    return {"merge_seconds": statistics.median(merges),
            "decode_tokens_per_s_merged": statistics.median(rates["merged"]),
            "decode_tokens_per_s_unmerged": statistics.median(rates["unmerged"])}


def in_child(argv: list[str]) -> dict:
    """This benchmark's own subcommand in a fresh interpreter; its JSON line back."""
    out = subprocess.run([sys.executable, "-m", "rollwise", "bench", "lora", *argv],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_run(args, name: str, seed: int, lr: float, steps: int, lora: bool) -> dict:
    """One `rollwise train` in its own process; its summary against the target. A run that
    finished under --root before is read back, one that stopped is resumed: the benchmark
    run again after a crash or a full disk redoes only what was lost."""
    extra = lora_overrides(args) if lora else []
    run_dir = Path(args.root) / name
    cmd = [sys.executable, "-m", "rollwise", "train", "--config", args.config,
           *args.overrides, *QUIET, *extra, f"run.root={args.root}", f"run.name={name}",
           f"run.seed={seed}", f"train.lr={lr}", f"train.steps={steps}"]
    if (run_dir / "checkpoints").is_dir() and not (run_dir / "summary.json").exists():
        cmd = [sys.executable, "-m", "rollwise", "train", "--resume", str(run_dir)]
    t0 = time.time()
    if not (run_dir / "summary.json").exists():
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    # only the metrics are read: a full model's checkpoints would fill the disk over a sweep
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = summarize("lora" if lora else "full", seed, rollwise_clock(rows), args.target)
    wall = json.loads((run_dir / "summary.json").read_text())["wall_seconds"]
    out.update(lr=lr, wall_seconds=wall, run=name, seconds_here=time.time() - t0)
    print(f"{name}: pass@1 {out['pass1_start']:.3f} -> {out['pass1_final']:.3f}, "
          f"target at step {out['steps_to_target']}, {out['wall_seconds']:.0f}s",
          file=sys.stderr, flush=True)
    return out


def sweep(args, arm: str, lrs: list[float]) -> tuple[float, list[dict]]:
    runs = [train_run(args, f"sweep-{arm}-lr{lr:g}", 0, lr, args.sweep_steps, arm == "lora")
            for lr in lrs]
    score = lambda r: statistics.mean(p for s, _, p in r["curve"] if s > 0)  # noqa: E731
    best = max(runs, key=score)
    return best["lr"], [{**r, "sweep_score": score(r)} for r in runs]


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [x - y for x, y in zip(a, b)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return statistics.mean(d), se


def learning(args) -> dict:
    lr = {"full": args.full_lr, "lora": args.lora_lr}
    sweeps = {}
    for arm, lrs in (("full", args.full_lrs), ("lora", args.lora_lrs)):
        if lr[arm] is None:
            lr[arm], sweeps[arm] = sweep(args, arm, lrs)
    runs = {arm: [train_run(args, f"{arm}-seed{s}", s, lr[arm], args.steps, arm == "lora")
                  for s in args.seeds] for arm in ("full", "lora")}
    finals = {arm: [r["pass1_final"] for r in rs] for arm, rs in runs.items()}
    times = {arm: statistics.median(r["seconds_to_target"] for r in rs)
             for arm, rs in runs.items()}
    delta, se = paired(finals["lora"], finals["full"])
    return {"lr": lr, "sweeps": sweeps, "runs": runs,
            "final_pass1_mean": {a: statistics.mean(f) for a, f in finals.items()},
            "final_pass1_delta": delta, "final_pass1_delta_se": se,
            "median_seconds_to_target": times,
            "time_to_target_ratio": times["lora"] / times["full"]
            if math.isfinite(times["full"]) and times["full"] > 0 else None}


def mechanics_summary(full: dict, lora: dict) -> dict:
    return {"sync_bytes_ratio": full["sync_bytes"] / lora["sync_bytes"],
            "optimizer_bytes_ratio": full["optimizer_bytes"] / lora["optimizer_bytes"],
            "checkpoint_bytes_ratio": full["checkpoint_bytes"] / lora["checkpoint_bytes"],
            "update_speed_ratio": lora["update_tokens_per_s"] / full["update_tokens_per_s"],
            "peak_rss_ratio": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
            "update_memory_ratio": full["peak_rss_over_model_bytes"] /
            lora["peak_rss_over_model_bytes"]}


def parse(argv):
    p = argparse.ArgumentParser(prog="rollwise bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm2", help="a preset or YAML file")
    p.add_argument("--part", choices=["all", "mechanics", "learning"], default="all")
    p.add_argument("--arm", choices=["groups", "full", "lora"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--targets", default="all-linear")
    p.add_argument("--repeats", type=int, default=3, help="updates timed per arm")
    p.add_argument("--decode-requests", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sweep-steps", type=int, default=10)
    p.add_argument("--full-lrs", type=float, nargs="+", default=[1e-5, 2e-5, 5e-5])
    p.add_argument("--lora-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    p.add_argument("--full-lr", type=float, help="skip the full arm's sweep: use this rate")
    p.add_argument("--lora-lr", type=float, help="skip the LoRA arm's sweep: use this rate")
    p.add_argument("--target", type=float, default=0.45)
    p.add_argument("--root", default="runs/bench-lora")
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.arm:  # a child of the mechanics part: its JSON on the last line
        print(json.dumps(make_groups(args) if args.arm == "groups" else
                         measure_arm(args, args.arm)))
        return 0
    out = {"config": args.config, "rank": args.rank, "targets": args.targets,
           "overrides": args.overrides}
    if args.part in ("all", "mechanics"):
        common = ["--config", args.config, "--rank", str(args.rank), "--targets", args.targets,
                  "--repeats", str(args.repeats), "--root", args.root,
                  "--decode-requests", str(args.decode_requests),
                  "--decode-tokens", str(args.decode_tokens), *args.overrides]
        in_child(["--arm", "groups", *common])
        arms = {arm: in_child(["--arm", arm, *common]) for arm in ("full", "lora")}
        out["mechanics"] = {**arms, "summary": mechanics_summary(arms["full"], arms["lora"])}
        print(json.dumps(out["mechanics"]["summary"], indent=1), file=sys.stderr, flush=True)
    if args.part in ("all", "learning"):
        out["learning"] = learning(args)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
