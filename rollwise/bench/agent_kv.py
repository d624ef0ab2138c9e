"""Agent episodes with and without the built-in engine's prefix cache, side by side:

    rollwise bench agent_kv --json [--scenario calc|long] [--repeats 5] [--problems 64]

One round of episodes, problems x group_size, sampled with fixed per-episode seeds, on a fresh
engine per round: engine.prefix_cache_tokens=0 (each turn's request prefills the episode so far)
against auto (it prefills only the environment's tokens). The arms run in turn, --repeats
times; the episodes must be the same token for token.

- calc: the calculator task's warm start (configs/calc.yaml, made and cached as `rollwise bench
  agents` makes it): short episodes, most of them one or two turns.
- long: the default-size model, untrained, with 1024 positions, after a 64-token prompt; its
  turns end at one of 4 stop tokens (about 13 tokens, at most 48), and an environment answers
  each with 15 tokens, for 8 turns: an episode grows to about 300 tokens (agents with many
  turns and tool outputs).

Top-level keys: kv_round_speedup (median seconds per round without the cache over with it) and
kv_prefill_saved (the share of prefilled tokens the cache avoided).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from rollwise import models
from rollwise.agents.episode import EpisodeGenerator
from rollwise.bench.agents import CALC, DEFAULTS, warm_start
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine
from rollwise.engine.sizing import prefix_cache_tokens
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.group import sampling_params
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks import Problem, load_task
from rollwise.tasks.prompts import Prompter


def play_round(cfg, model, tokenizer, problems, stop_ids, cache: int) -> dict:
    engine = BuiltinEngine(model, max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                    segment=cfg.engine.segment, prefix_cache_tokens=cache)
    rollout = Rollout(engine, RunToEnd(), Ledger(), sampling_params(cfg.generate, stop_ids))
    t0 = time.perf_counter()
    EpisodeGenerator(cfg, tokenizer, seed=cfg.run.seed).generate(rollout, problems, step=1)
    seconds = time.perf_counter() - t0
    d = rollout.ledger.decisions
    return {"seconds": seconds, "prefill_tokens": engine.prefill_tokens,
            "reused_tokens": engine.prefix_hit_tokens,
            "generated_tokens": engine.tokens_generated, "turns": d["agent/turn/model"],
            "reprefilled": d["agent/reprefill/tokens"],
            "episodes": [s.response_ids for g in rollout.groups for s in g.samples]}


class Echo:
    """The long scenario's environment: 15 tokens back after every turn (';user: 0123456;' on
    the character model), never done."""

    def __init__(self, cfg, problem):
        pass

    def reset(self, problem):
        return None

    def step(self, action):
        return "0123456", 0.0, False, {}


def calc_setup(base: list[str], problems: int, log):
    init = warm_start(CALC, base, log)
    cfg = load_config(CALC, base + ["run.seed=0"])
    model, tokenizer = models.load_model(init)
    task = load_task(cfg.task)
    prompter = Prompter.for_task(cfg.task, tokenizer, task)
    return cfg, model, tokenizer, prompter.render(task.train[:problems]), prompter.stop_ids


def long_setup(base: list[str], problems: int, log):

    cfg = load_config(None, base + [
        "run.seed=0", "model.max_positions=1024", "generate.strategy=episode",
        "generate.env=rollwise.bench.agent_kv:Echo", "generate.max_new_tokens=48",
        "generate.max_turns=8", "generate.max_episode_tokens=800"])
    model, tokenizer = models.build(cfg.model, seed=0)
    rng = random.Random(0)
    out = []
    for i in range(problems):
        text = "".join(rng.choice("0123456789+*=") for _ in range(64))
        p = Problem(f"long{i}", text, "")
        p.prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(p)
    return cfg, model, tokenizer, out, tuple(tokenizer.encode("abcd", add_special_tokens=False))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench agent_kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["calc", "long"], default="calc")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--root", default="runs/bench-agents")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    base = [*DEFAULTS, *args.overrides, f"run.root={args.root}"]
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    setup = calc_setup if args.scenario == "calc" else long_setup
    cfg, model, tokenizer, problems, stop_ids = setup(base, args.problems, log)
    arms = {"off": 0, "on": prefix_cache_tokens(cfg)}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for i in range(args.repeats):
        for arm, cache in arms.items():
            runs[arm].append(play_round(cfg, model, tokenizer, problems, stop_ids, cache))
        if runs["on"][-1].pop("episodes") != runs["off"][-1].pop("episodes"):
            raise AssertionError("the prefix cache changed the episodes' tokens")
        log(f"repeat {i}: off {runs['off'][-1]['seconds']:.2f}s, on "
            f"{runs['on'][-1]['seconds']:.2f}s")
    med = {a: statistics.median(r["seconds"] for r in rs) for a, rs in runs.items()}
    off, on = runs["off"][0], runs["on"][0]
    out = {"kv_round_speedup": med["off"] / med["on"],
           "kv_prefill_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
           "scenario": args.scenario, "median_seconds": med,
           "prefix_cache_tokens": arms["on"],
           "episodes": args.problems * cfg.generate.group_size, "repeats": args.repeats,
           "per_round": {a: {k: v for k, v in rs[0].items() if k != "seconds"}
                         for a, rs in runs.items()},
           "seconds": {a: [r["seconds"] for r in rs] for a, rs in runs.items()}}
    print(json.dumps(out, indent=2) if args.json else
          f"round: {med['off']:.2f}s without the prefix cache, {med['on']:.2f}s with it "
          f"({out['kv_round_speedup']:.2f}x); prefilled {off['prefill_tokens']} -> "
          f"{on['prefill_tokens']} tokens ({100 * out['kv_prefill_saved']:.0f} % saved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
