"""Generation inside the training loop against the engine alone at the same shape, and where a
step's time goes.

    rollwise bench loop --config smollm2 --steps 4 [--json] [KEY=VALUE ...]

Runs `rollwise train` on the config for --steps steps and reads each step's phase times
(generate, score, train, sync) and generated tokens from its metrics. Then the engine alone:
a fresh engine built as the run builds it (same backend settings, dtype and slots), from the
run's starting weights, given each step's requests as the loop gave them (same prompts, same
order, same sampling settings) with every response's length forced to what the loop
generated (max_new_tokens = its length, no stop ids). Same prompts, same lengths, so the same
compute: what remains is the loop's own cost around its engine. Reported per step and as
medians: the loop's generation tokens/s over the engine alone's, and scoring's share of the
step (scoring runs after generation unless the config overlaps it).

The same requests also go through the built-in engine's eager path (engine.graph=off, the
runner), so each step's time is set beside what it would have been with that engine at the
same samples: the step's other phases as measured, generation as the runner's replay took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

QUIET = ["run.log=quiet", "run.report=false", "run.tensorboard=false"]


def run_loop(config: str, steps: int, root: str, overrides: list[str]):
    """The run's config and its directory, after `steps` steps of rollwise train."""
    import rollwise
    from rollwise.config import load_config
    cfg = load_config(config, [*overrides, *QUIET, f"run.root={root}", "run.name=bench-loop",
                               f"train.steps={steps}", f"run.eval_every={10 * steps}",
                               f"run.checkpoint_every={10 * steps}"])
    rollwise.train(cfg)
    return cfg, Path(root) / "bench-loop"


def step_requests(run_dir: Path) -> dict[int, list[tuple[list[int], int]]]:
    """Each step's (prompt ids, response length), in the order the loop stored them."""
    from rollwise.store.rollouts import RolloutStore
    table = RolloutStore(run_dir / "rollouts").read()
    out: dict[int, list] = {}
    for r in table.select(["step", "prompt_ids", "response_ids"]).to_pylist():
        if r["response_ids"]:
            out.setdefault(r["step"], []).append((r["prompt_ids"], len(r["response_ids"])))
    return out


def engine_alone(cfg, model, tok, run_dir: Path, requests: list[tuple[list[int], int]]
                 ) -> float:
    """Seconds for a fresh engine, built as the run builds it on `model`, to generate these
    requests with their lengths forced."""
    from rollwise.engine import Request, SamplingParams
    from rollwise.engine.backends import build_engine
    engine = build_engine(cfg, model, tok, run_dir / "engine-alone")
    engine.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=2))])  # compiles, if
    # the engine does, before the clock (the loop's engine compiled before its first step)
    g = cfg.generate
    reqs = [Request(p, SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                      max_new_tokens=n, seed=i), i)
            for i, (p, n) in enumerate(requests)]
    try:
        engine.generate(reqs[:8])  # warm-up, as the loop's engine is warm by its later steps
        t = time.perf_counter()
        done = engine.generate(reqs)
        seconds = time.perf_counter() - t
    finally:
        engine.close()
    made, want = sum(len(c.token_ids) for c in done), sum(n for _, n in requests)
    if made != want:  # a shorter replay would not be the same compute
        raise RuntimeError(f"the engine alone generated {made} tokens of the {want} forced")
    return seconds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--root", default="runs/bench-loop")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY=VALUE")
    args = ap.parse_args(argv)
    cfg, run_dir = run_loop(args.config, args.steps, args.root, args.overrides)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    requests = step_requests(run_dir)
    from rollwise import models
    model, tok = models.build(cfg.model, seed=cfg.run.seed)  # shaped as the run's
    rows = []
    for m in metrics:
        step = m.get("step")
        if step not in requests or "perf/phase/generate_seconds" not in m:
            continue
        tokens = sum(n for _, n in requests[step])
        alone = engine_alone(cfg, model, tok, run_dir, requests[step])
        runner = engine_alone(cfg.model_copy(update={"engine": cfg.engine.model_copy(
            update={"graph": "off"})}), model, tok, run_dir, requests[step])
        loop_gen = m["perf/phase/generate_seconds"]
        step_s = m["perf/step_seconds"]
        rows.append({"step": step, "tokens": tokens, "loop_generate_s": loop_gen,
                     "engine_alone_s": alone, "loop_over_engine": alone / loop_gen,
                     "runner_alone_s": runner,
                     "step_over_runner_step": step_s / (step_s - loop_gen + runner),
                     "score_s": m.get("perf/phase/score_seconds", 0.0),
                     "train_s": m.get("perf/phase/train_seconds", 0.0),
                     "sync_s": m.get("perf/phase/sync_seconds", 0.0),
                     "step_s": m["perf/step_seconds"],
                     "score_share": m.get("perf/phase/score_seconds", 0.0) /
                     m["perf/step_seconds"]})
    # the first step's phase times also hold what ran before it (the held-out evaluation at
    # the start, worker pools starting): the medians take the later steps
    later = rows[1:] or rows
    result = {"benchmark": "loop", "config": args.config, "overrides": args.overrides,
              "steps": args.steps, "rows": rows,
              "median_loop_over_engine": statistics.median(r["loop_over_engine"] for r in later),
              "median_step_over_runner_step": statistics.median(
                  r["step_over_runner_step"] for r in later),
              "median_score_share": statistics.median(r["score_share"] for r in later)}
    print(json.dumps(result) if args.json else table(result))
    return 0


def table(result: dict) -> str:
    lines = ["| step | tokens | loop generate s | engine alone s | loop / engine | runner "
             "alone s | score s | train s | sync s | step s | step / runner's step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['step']} | {r['tokens']} | {r['loop_generate_s']:.1f} | "
                     f"{r['engine_alone_s']:.1f} | {r['loop_over_engine']:.2f} | "
                     f"{r['runner_alone_s']:.1f} | {r['score_s']:.2f} | {r['train_s']:.1f} | "
                     f"{r['sync_s']:.2f} | {r['step_s']:.1f} | "
                     f"{r['step_over_runner_step']:.2f} |")
    lines.append(f"\nmedian (steps after the first): loop generation at "
                 f"{result['median_loop_over_engine']:.2f}x the engine alone's speed; scoring "
                 f"{result['median_score_share']:.1%} of the step; a step takes "
                 f"{result['median_step_over_runner_step']:.2f}x its time with the runner")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
