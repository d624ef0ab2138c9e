"""Engine throughput: the built-in engine against Hugging Face `generate` (padded static batches)
and vLLM (in its own environment, .venv-vllm); same model, same prompts, same tokens, and each
figure beside the machine's decode bound (bench roofline).

    rollwise bench engine [--json] [--repeats 3] [--threads 2] [--preset tiny|0.5b]
    rollwise bench engine --shape rl --config smollm2 --dtype bfloat16

Every request's length is forced by its own max_new_tokens (no stop ids), so each engine
produces the same number of tokens; tokens/s counts those requested tokens only. Greedy.
Shapes:
  short (the tiny model's fast check), each with 256 requests through 64 slots (HF
  `generate`: 4 padded batches of 64) and with 64 requests in one batch:
    equal     every response 32 tokens
    longtail  geometric lengths (median ~12) with 1 in 20 responses 10x the median
    rl        512 requests (64 prompts x 8 samples) x 8 tokens in one batch
  rl (a real model's RL step): 64 prompts x 8 samples through 64 slots, and all 512 at once
  (the loop's engine holds up to engine.max_batch = 1024; HF: one padded batch)
    equal     every response 128 tokens
    longtail  geometric lengths (median 48) capped at 256, 1 in 10 runs to the cap (responses
              that never reach their answer)
Prompts: with --config, the task's own (rendered by its chat template, 8 samples per problem);
otherwise 10 random token ids from the whole vocabulary. Median of --repeats runs after one
warm-up, taken in turn across backends. `of_bound`: tokens/s over the roofline bound at the
slots' batch and the mean context (rollwise.bench.roofline.decode_bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollwise import models
from rollwise.bench import roofline
from rollwise.config import ModelConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.vllm import VLLMEngine

# (kind, requests, slots, the length profile)
SHAPES = {"short": [("equal", 256, 64), ("equal", 64, 64), ("longtail", 256, 64),
                    ("longtail", 64, 64), ("rl", 512, 512)],
          "rl": [("equal", 512, 64), ("longtail", 512, 64), ("equal", 512, 512),
                 ("longtail", 512, 512)]}


def lengths_for(kind: str, n: int, shape: str = "short", seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if shape == "rl":
        if kind == "equal":
            return [128] * n
        return [256 if rng.random() < 0.1 else min(256, _geometric(rng, 48)) for _ in range(n)]
    if kind == "equal":
        return [32] * n
    if kind == "rl":
        return [8] * n
    return [120 if rng.random() < 0.05 else _geometric(rng, 12) for _ in range(n)]


def _geometric(rng: random.Random, median: int) -> int:
    p = 1 - 0.5 ** (1 / median)  # geometric with this median
    return 1 + int(math.log(1 - rng.random()) / math.log(1 - p))


def prompts_for(kind: str, n: int, vocab: int, shape: str = "short", seed: int = 0,
                task_prompts: list[list[int]] | None = None) -> list[list[int]]:
    """n prompts; in RL shapes (and 'rl' requests) 8 samples share each prompt (a GRPO group).
    task_prompts: the task's rendered prompts to take them from; else 10 random ids."""
    grouped = shape == "rl" or kind == "rl"
    distinct = distinct_prompts(kind, n, shape)
    if task_prompts is not None:
        if len(task_prompts) < distinct:
            raise ValueError(f"the task gave {len(task_prompts)} prompts; {distinct} needed")
        base = task_prompts[:distinct]
    else:
        rng = random.Random(seed + 1)
        base = [[rng.randrange(3, vocab) for _ in range(10)] for _ in range(distinct)]
    return [base[i // 8] for i in range(n)] if grouped else base


def distinct_prompts(kind: str, n: int, shape: str) -> int:
    """How many different prompts n requests have (groups of 8 in RL shapes)."""
    return n // 8 if shape == "rl" or kind == "rl" else n


def task_prompts(config, tokenizer, n: int) -> list[list[int]]:
    """The first n training prompts of a config's task (a path or a Config), as its runs
    render them."""
    from rollwise.config import Config, load_config
    from rollwise.tasks import load_task
    from rollwise.tasks.prompts import Prompter
    cfg = config if isinstance(config, Config) else load_config(config)
    task = load_task(cfg.task)
    prompter = Prompter.for_task(cfg.task, tokenizer, task)
    return [prompter.ids(p) for p in task.train[:n]]


def build_model(preset: str, model_dir: str | None):
    if model_dir:
        return models.load_model(model_dir)
    if preset == "0.5b":  # Qwen2.5-0.5B's shape, random weights
        from transformers import AutoModelForCausalLM, Qwen2Config
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                          max_position_embeddings=4096, tie_word_embeddings=True)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).eval(), models.char_tokenizer()
    return models.build(ModelConfig(max_positions=1024), seed=0)


def model_dir_of(args) -> str | None:
    """--model-dir, or the model a --config names (a catalog name or a folder)."""
    if args.model_dir or not args.config:
        return args.model_dir
    from rollwise.config import load_config
    return str(models.resolve_path(load_config(args.config).model.path))


def run_builtin(model, prompts, lengths, slots, graph: str = "off") -> int:
    engine = BuiltinEngine(model, max_batch=slots, copy_model=False, graph=graph)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=n), i)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    return sum(len(c.token_ids) for c in engine.generate(reqs))


def run_graph(model, prompts, lengths, slots) -> int:
    """The built-in engine on its decode graph (compiled on a CPU, captured on CUDA)."""
    return run_builtin(model, prompts, lengths, slots, graph="compile")


@torch.inference_mode()
def run_hf(model, prompts, lengths, slots) -> int:
    """Padded static batches of `slots`: each batch runs to its longest request."""
    done = 0
    for a in range(0, len(prompts), slots):
        batch, want = prompts[a:a + slots], lengths[a:a + slots]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        dev = next(model.parameters()).device
        out = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max(want),
                             min_new_tokens=max(want), do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        done += sum(min(n, out.shape[1] - width) for n in want)
    return done


def run_vllm(engine, prompts, lengths, slots) -> int:
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=n), i)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    done = sum(len(c.token_ids) for c in engine.generate(reqs))  # max_batch = slots
    if done != sum(lengths):
        raise RuntimeError(f"vLLM generated {done} tokens of the {sum(lengths)} requested")
    return done


def measure(fns: dict, repeats: int, warmups: dict | None = None,
            warmup_seconds: dict | None = None) -> dict[str, tuple[float, int]]:
    """Median tokens/s of each backend; one warm-up each (`warmups`, else the run itself; its
    seconds go to `warmup_seconds`: a compiling backend's first one includes its compile),
    then the repeats taken in turn (builtin, hf, builtin, hf, ...) so a change in the shared
    machine's load hits both alike."""
    for name, fn in fns.items():
        t = time.perf_counter()
        (warmups or fns)[name]()
        if warmup_seconds is not None:
            warmup_seconds[name] = time.perf_counter() - t
    rates: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            tokens[name] = fn()
            rates[name].append(tokens[name] / (time.perf_counter() - t))
    return {name: (statistics.median(rates[name]), tokens[name]) for name in fns}


def bench_local(args, backends: list[str], model, prompts_of) -> list[dict]:
    """Each scenario of args.shape on `backends` run in this process (vLLM only when it is
    importable here: the subprocess path runs this)."""
    vllm_engines = {}
    rows = []
    longest = max(max(map(len, prompts_of(kind, n))) + max(lengths_for(kind, n, args.shape))
                  for kind, n, _ in SHAPES[args.shape])  # one vLLM engine serves every scenario
    for kind, n, slots in SHAPES[args.shape]:
        prompts, lengths = prompts_of(kind, n), lengths_for(kind, n, args.shape)
        fns, warmups = {}, {}
        for name in backends:
            if name == "vllm":
                if slots not in vllm_engines:
                    vllm_engines[slots] = VLLMEngine(args.model_dir, max_batch=slots,
                                                     entropy_logprobs=1, dtype=args.dtype,
                                                     max_model_len=max(256, longest))
                eng = vllm_engines[slots]
                fns[name] = lambda eng=eng: run_vllm(eng, prompts, lengths, slots)
                warmups[name] = lambda eng=eng: run_vllm(eng, prompts[:slots], [4] * slots,
                                                         slots)
            else:
                run = {"builtin": run_builtin, "graph": run_graph, "hf": run_hf}[name]
                fns[name] = lambda run=run: run(model, prompts, lengths, slots)
                warmups[name] = lambda run=run: run(model, prompts[:slots], [4] * slots, slots)
        context = statistics.mean(map(len, prompts)) + statistics.mean(lengths) / 2
        warm = warmups if args.shape == "rl" else None  # a full RL-shape run is minutes
        warm_s: dict[str, float] = {}
        for name, (rate, tokens) in measure(fns, args.repeats, warm, warm_s).items():
            rows.append(dict(scenario=kind, requests=n, slots=slots, backend=name,
                             tokens=tokens, tokens_per_s=round(rate, 1),
                             mean_context=round(context, 1),
                             warmup_s=round(warm_s[name], 2)))
            if not args.json:
                print(f"  {kind:9s} {n:4d} req / {slots:3d} slots  {name:8s} {rate:9.0f} tok/s",
                      file=sys.stderr)
    return rows


def bench_vllm_subprocess(args, python: str, model, tok) -> list[dict]:
    """vLLM in its own environment on the same model (saved in a temporary folder unless it
    is a folder already) and the same prompts (the task config is passed on)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            models.save(model, tok, Path(tmp) / "model")
            model_dir = str(Path(tmp) / "model")
        cmd = [python, "-m", "rollwise.bench.engine", "--json", "--backends", "vllm",
               "--model-dir", model_dir, "--repeats", str(args.repeats), "--shape",
               args.shape, "--dtype", args.dtype, "--threads", str(torch.get_num_threads()),
               "--no-roofline"] + (["--config", args.config] if args.config else [])
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                      "2")}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"vLLM run failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            return []
        return json.loads(out.stdout.strip().splitlines()[-1])["rows"]


def add_bounds(rows: list[dict], model, peaks: dict) -> None:
    """Each row's roofline bound at its batch (the slots, or fewer requests) and context."""
    for r in rows:
        bound = roofline.decode_bound(model, peaks, min(r["slots"], r["requests"]),
                                      r["mean_context"])
        r["bound_tokens_per_s"] = round(bound, 1)
        r["of_bound"] = round(r["tokens_per_s"] / bound, 4)


def table(rows: list[dict]) -> str:
    keyed = {}
    for r in rows:
        keyed.setdefault((r["scenario"], r["requests"], r["slots"]), {})[r["backend"]] = r
    lines = ["| scenario | requests / slots | graph tok/s | built-in eager tok/s | "
             "HF generate tok/s | vLLM tok/s | graph / eager | graph / HF | graph / vLLM | "
             "graph of bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, n, slots), by in keyed.items():
        def cell(b):
            return f"{by[b]['tokens_per_s']:.0f}" if b in by else "-"

        def ratio(b):
            return f"{by['graph']['tokens_per_s'] / by[b]['tokens_per_s']:.2f}x" \
                if "graph" in by and b in by else "-"
        bound = f"{by['graph']['of_bound']:.0%}" if "of_bound" in by.get("graph", {}) \
            else "-"
        lines.append(f"| {kind} | {n} / {slots} | {cell('graph')} | {cell('builtin')} | "
                     f"{cell('hf')} | {cell('vllm')} | {ratio('builtin')} | {ratio('hf')} | "
                     f"{ratio('vllm')} | {bound} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--preset", choices=["tiny", "0.5b"], default="tiny")
    ap.add_argument("--model-dir", default=None, help="a local HF model folder instead")
    ap.add_argument("--config", default=None,
                    help="a run config: its model (unless --model-dir) and its task's prompts")
    ap.add_argument("--shape", choices=list(SHAPES), default="short")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' and K/V's dtype, for every backend")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="graph,builtin,hf,vllm",
                    help="graph: the built-in engine's decode graph; builtin: its eager path "
                         "(the runner); hf: HF generate; vllm: vLLM in .venv-vllm")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                    help="the vLLM environment's python (skipped if missing)")
    ap.add_argument("--no-roofline", action="store_true", help="skip measuring the bounds")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = model_dir_of(args)
    backends = args.backends.split(",")
    vllm_here = importlib.util.find_spec("vllm") is not None and args.model_dir is not None
    local = [b for b in backends if b != "vllm" or vllm_here]
    model, tok = build_model(args.preset, args.model_dir)
    model = model.to(args.device, getattr(torch, args.dtype)).eval()
    vocab = model.get_input_embeddings().num_embeddings
    distinct = max(distinct_prompts(kind, n, args.shape) for kind, n, _ in SHAPES[args.shape])
    given = task_prompts(args.config, tok, distinct) if args.config else None

    def prompts_of(kind: str, n: int) -> list[list[int]]:
        return prompts_for(kind, n, vocab, args.shape, task_prompts=given)
    rows = bench_local(args, local, model, prompts_of)
    if "vllm" in backends and not vllm_here:
        if Path(args.vllm_python).exists():
            rows += bench_vllm_subprocess(args, args.vllm_python, model, tok)
        elif not args.json:
            print(f"vLLM skipped: no {args.vllm_python} (bash scripts/setup_vllm.sh)",
                  file=sys.stderr)
    result = dict(benchmark="engine", preset=args.preset, model_dir=args.model_dir,
                  shape=args.shape, dtype=args.dtype, device=args.device,
                  threads=torch.get_num_threads(), repeats=args.repeats)
    if not args.no_roofline:
        peaks = roofline.measure(args.device)
        add_bounds(rows, model, peaks)
        result["roofline"] = peaks
    result["rows"] = rows
    print(json.dumps(result) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
