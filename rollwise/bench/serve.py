"""A load test of the OpenAI-compatible endpoints, on 127.0.0.1 only: N agents at once, each a
two-turn conversation through the real `openai` client (rollwise.serve.agent), against the same
rollouts driven through the built-in episode generator (generate.strategy=episode, an
environment that answers the first turn with "Go on." and ends at the second).

    rollwise bench serve --json [--model DIR] [--agents 8 64] [--tokens 32] [--repeats 3]

Every turn ends at the model's end of turn or at --tokens (an episode whose first turn ran
out of tokens ends there, in both arms), sampled at temperature 1 on a fresh
built-in engine per round (the arms' samples differ, so their token counts do too: tokens/s
is the measure). Per round: tokens/s (the
model's tokens over the round's wall time), the agent's call latency (p50/p99, as the client
timed it), and a check that every episode ended exactly once with its one or two calls, none
lost or repeated. The arms alternate, --repeats times; medians. Top-level key:
serve_tokens_ratio (the endpoint's tokens/s over the generator's, at the largest N).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rollwise import models
from rollwise.agents.episode import EpisodeGenerator
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, SamplingParams
from rollwise.engine.sizing import prefix_cache_tokens
from rollwise.serve.agent import AgentGenerator
from rollwise.serve.chat import Renderer
from rollwise.serve.service import Policy
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks.prompts import stop_ids
from rollwise.types import Problem

LATENCIES: list[float] = []  # seconds per call, as the agents timed them
TURN_TOKENS = 32


def two_turns(problem, client):
    """The load test's agent: a question, the model's answer, "Go on.", its second answer."""
    messages = list(problem.prompt)
    for turn in range(2):
        t0 = time.perf_counter()
        # max_tokens left out: the server's default, generate.max_new_tokens (--tokens)
        r = client.chat.completions.create(model=client.model, messages=messages)
        LATENCIES.append(time.perf_counter() - t0)
        if r.choices[0].finish_reason == "length":
            break  # as the episode generator ends an episode whose turn ran out of tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": "Go on."})
    return 0.0


class GoOnOnce:
    """The generator arm's environment: "Go on." after the first turn, done after the second."""

    def __init__(self, cfg, problem):
        self.turns = 0

    def reset(self, problem):
        return None

    def step(self, action):
        self.turns += 1
        return ("Go on.", 0.0, False, {}) if self.turns < 2 else (None, 0.0, True, {})


def problems(tok, n: int) -> list[Problem]:
    render = Renderer(tok)
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} + {2 * i + 1}?"}]
        p = Problem(f"q{i}", messages, str(3 * i + 1))
        p.prompt_ids = render.prompt_ids(messages)
        out.append(p)
    return out


def config(model: str | None, n: int, tokens: int):
    model_keys = [f"model.path={model}"] if model else ["model.max_positions=256"]
    return load_config(None, [*model_keys, "generate.group_size=1",
                              f"generate.max_new_tokens={tokens}", "generate.max_turns=2",
                              "generate.strategy=agent",
                              "generate.agent=rollwise.bench.serve:two_turns",
                              "generate.env=rollwise.bench.serve:GoOnOnce",
                              f"generate.agent_concurrency={n}", "generate.agent_timeout_s=600"])


def engine(cfg, model) -> BuiltinEngine:
    """A fresh engine, its prefix cache sized as a run sizes it for agents (both arms alike:
    a second turn prefills only what was added)."""
    return BuiltinEngine(model, seed=0, prefix_cache_tokens=prefix_cache_tokens(cfg))


def endpoint_round(cfg, model, tok, qs) -> dict:
    LATENCIES.clear()
    gen = AgentGenerator(cfg, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.generate.max_new_tokens,
                            stop_ids=stop_ids(tok, model.config))
    ledger = Ledger()
    try:
        gen.serve(params)  # the server starts before the clock, as in a run's later rounds
        t0 = time.perf_counter()
        played = gen.play(engine(cfg, model), params, qs, Policy(1.0, 1.0), None, ledger,
                          per_problem=1)
        wall = time.perf_counter() - t0
    finally:
        gen.close()
    ended = sorted(ep.problem.id for ep, _ in played if ep.error is None)
    calls = [sum(p.calls for p in pieces) for _, pieces in played]
    tokens = sum(sum(p.mask) for _, pieces in played for p in pieces)
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_s": statistics.median(LATENCIES),
            "p99_s": sorted(LATENCIES)[min(len(LATENCIES) - 1, int(0.99 * len(LATENCIES)))],
            "episodes_ok": ended == sorted(q.id for q in qs) and all(c in (1, 2) for c in calls),
            "turns": sum(calls),
            "splits": ledger.decisions.get("agent/split/rewrite", 0)}


def generator_round(cfg, model, tok, qs) -> dict:
    gen = EpisodeGenerator(cfg, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.generate.max_new_tokens,
                            stop_ids=stop_ids(tok, model.config))
    t0 = time.perf_counter()
    rollout = Rollout(engine(cfg, model), RunToEnd(), Ledger(), params)
    gen.generate(rollout, qs, step=1)
    wall = time.perf_counter() - t0
    samples = [s for g in rollout.groups for s in g.samples]
    tokens = sum(sum(s.loss_mask) for s in samples)
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "episodes_ok": len(samples) == len(qs),
            "turns": sum(s.meta.get("turns", 0) for s in samples)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the built-in "
                                                 "character model, untrained)")
    p.add_argument("--agents", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, default=TURN_TOKENS, help="tokens per turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.model:
        model, tok = models.load_model(args.model)
    else:
        cfg = config(None, 1, args.tokens)
        tok = models.char_tokenizer()
        model = models.tiny_model(cfg.model, len(tok), tok.pad_token_id, tok.eos_token_id)
    rows = []
    for n in args.agents:
        cfg, qs = config(args.model, n, args.tokens), problems(tok, n)
        runs = {"endpoint": [], "generator": []}
        for _ in range(args.repeats):
            runs["endpoint"].append(endpoint_round(cfg, model, tok, qs))
            runs["generator"].append(generator_round(cfg, model, tok, qs))
        row = {"agents": n}
        for arm, rs in runs.items():
            row[arm] = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                        if k != "episodes_ok"}
            row[arm]["episodes_ok"] = all(r["episodes_ok"] for r in rs)
        row["tokens_ratio"] = row["endpoint"]["tokens_per_s"] / row["generator"]["tokens_per_s"]
        rows.append(row)
        print(f"{n:3d} agents: endpoint {row['endpoint']['tokens_per_s']:.0f} tok/s (p50 "
              f"{row['endpoint']['p50_s']:.2f}s, p99 {row['endpoint']['p99_s']:.2f}s), "
              f"generator {row['generator']['tokens_per_s']:.0f} tok/s: "
              f"{row['tokens_ratio']:.2f}x; every episode once: "
              f"{row['endpoint']['episodes_ok'] and row['generator']['episodes_ok']}",
              file=sys.stderr, flush=True)
    out = {"serve_tokens_ratio": rows[-1]["tokens_ratio"], "rows": rows,
           "model": args.model or "built-in character model", "tokens_per_turn": args.tokens}
    print(json.dumps(out, indent=2) if args.json else "")
    return 0
