"""The decode graph's start-up and numerics on a real model.

    rollwise bench graph --config smollm2 --dtype bfloat16 --threads 2 [--json]

start-up  two fresh processes in turn, sharing a new, empty compile cache
          (TORCHINDUCTOR_CACHE_DIR): each loads the model and runs the built-in engine with
          engine.graph=compile on one short request. The first compiles the decode graph
          (every structure a run meets: DecodeGraph.warm_up); the second finds it on disk.
          Reported: the graph's compile (or load) seconds, the engine's start from
          construction to its first tokens, and how many compiled graphs each process built
          and loaded from the cache.
numerics  the task's prompts sampled at temperature 1 by the decode graph and by the runner
          (engine.graph=off), each token's behaviour log-probability set against a full
          forward pass of the same model over the finished sequence (Hugging Face's modules,
          the same dtype): the mean and largest absolute differences.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import counters

from rollwise import models
from rollwise.bench.engine import model_dir_of, task_prompts
from rollwise.engine import BuiltinEngine, Request, SamplingParams


def start_once(model_dir: str, dtype: str) -> dict:
    """One process's engine start: model load, then engine construction to first tokens."""
    t = time.perf_counter()
    model, _ = models.load_model(model_dir)
    model = model.to(getattr(torch, dtype)).eval()
    loaded = time.perf_counter() - t
    t = time.perf_counter()
    engine = BuiltinEngine(model, copy_model=False, graph="compile")
    engine.generate([Request([1, 2, 3, 4], SamplingParams(max_new_tokens=4))])
    inductor = counters["inductor"]  # compiled graphs built, and those loaded from the cache
    return {"model_load_s": round(loaded, 2), "engine_start_s": round(time.perf_counter() - t, 2),
            "graph_compile_s": round(engine.graph_compile_seconds, 2),
            "graphs_compiled": inductor["fxgraph_cache_miss"],
            "graphs_from_cache": inductor["fxgraph_cache_hit"]}


def startup(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}
        runs = []
        for which in ("first (empty cache)", "second (cache on disk)"):
            cmd = [sys.executable, "-m", "rollwise.bench.graph", "--start-only",
                   "--model-dir", args.model_dir, "--dtype", args.dtype, "--threads",
                   str(torch.get_num_threads())]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            runs.append({"run": which, **json.loads(out.stdout.strip().splitlines()[-1])})
    return runs


@torch.no_grad()
def logprob_errors(model, engine: BuiltinEngine, prompts: list[list[int]], new_tokens: int
                   ) -> torch.Tensor:
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i)
              for i in range(len(prompts))]
    done = engine.generate([Request(p, q) for p, q in zip(prompts, params)])
    errors = []
    for p, c in zip(prompts, done):
        logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        errors.append((ref - torch.tensor(c.logprobs)).abs())
    return torch.cat(errors)


def numerics(args, model, prompts: list[list[int]]) -> list[dict]:
    rows = []
    for graph in ("compile", "off"):
        engine = BuiltinEngine(model, copy_model=False, graph=graph, max_batch=len(prompts))
        err = logprob_errors(model, engine, prompts, args.new_tokens)
        rows.append({"engine": "decode graph" if graph == "compile" else "runner",
                     "tokens": len(err), "mean_abs": err.mean().item(),
                     "max_abs": err.max().item()})
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench graph", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a run config: its model and prompts")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = model_dir_of(args)
    if args.model_dir is None:
        ap.error("give --config or --model-dir")
    if args.start_only:
        print(json.dumps(start_once(args.model_dir, args.dtype)))
        return 0
    result = {"benchmark": "graph", "model_dir": args.model_dir, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "startup": startup(args)}
    model, tok = models.load_model(args.model_dir)
    model = model.to(getattr(torch, args.dtype)).eval()
    prompts = task_prompts(args.config, tok, args.prompts) if args.config else \
        [[1, 2, 3 + i] for i in range(args.prompts)]
    result["numerics"] = numerics(args, model, prompts)
    if args.json:
        print(json.dumps(result))
    else:
        for r in result["startup"]:
            print(f"{r['run']}: engine start {r['engine_start_s']} s (graph compile "
                  f"{r['graph_compile_s']} s), model load {r['model_load_s']} s")
        for r in result["numerics"]:
            print(f"{r['engine']}: log-prob vs full forward, mean {r['mean_abs']:.2e}, "
                  f"largest {r['max_abs']:.2e} over {r['tokens']} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
