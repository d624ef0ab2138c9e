"""Engine throughput: the built-in engine against Hugging Face `generate` (padded static batches)
and, where its virtual environment exists, vLLM; same model, same prompts, same tokens.

    rollwise bench engine [--json] [--repeats 3] [--threads 2] [--preset tiny|0.5b]

Scenarios (every request's length is forced by its own max_new_tokens, no stop ids, so each
engine produces the same number of tokens; tokens/s counts those requested tokens only):
  equal     every response 32 tokens
  longtail  geometric lengths (median ~12) with 1 in 20 responses 10x the median: RL rollouts
  rl        the default RL step: 64 prompts x 8 samples x 8 tokens
each with 256 requests through 64 slots (HF `generate`: 4 padded batches of 64) and with 64
requests in one batch (rl: 512 in one batch). Greedy decoding. Median of --repeats runs,
taken in turn across backends.
vLLM runs in .venv-vllm (scripts/setup_vllm.sh) as a subprocess on a saved copy of the model.
"""

from __future__ import annotations

import argparse
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
from rollwise.config import ModelConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.vllm import VLLMEngine

SCENARIOS = [("equal", 256, 64), ("equal", 64, 64), ("longtail", 256, 64), ("longtail", 64, 64),
             ("rl", 512, 512)]


def lengths_for(kind: str, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if kind == "equal":
        return [32] * n
    if kind == "rl":
        return [8] * n
    median = 12
    p = 1 - 0.5 ** (1 / median)  # geometric with this median
    return [10 * median if rng.random() < 0.05 else
            1 + int(math.log(1 - rng.random()) / math.log(1 - p)) for _ in range(n)]


def prompts_for(kind: str, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Distinct 10-token prompts; for 'rl', 8 samples share each prompt (a GRPO group)."""
    rng = random.Random(seed + 1)
    distinct = n // 8 if kind == "rl" else n
    base = [[rng.randrange(3, vocab) for _ in range(10)] for _ in range(distinct)]
    return [base[i // 8] for i in range(n)] if kind == "rl" else base


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


def run_builtin(model, prompts, lengths, slots) -> int:
    engine = BuiltinEngine(model, max_batch=slots, copy_model=False)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=n), i)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    return sum(len(c.token_ids) for c in engine.generate(reqs))


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
    return sum(len(c.token_ids) for c in engine.generate(reqs))  # max_batch = slots


def measure(fns: dict, repeats: int) -> dict[str, tuple[float, int]]:
    """Median tokens/s of each backend; one warm-up each, then the repeats taken in turn
    (builtin, hf, builtin, hf, ...) so a change in the shared machine's load hits both alike."""
    for fn in fns.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            tokens[name] = fn()
            rates[name].append(tokens[name] / (time.perf_counter() - t))
    return {name: (statistics.median(rates[name]), tokens[name]) for name in fns}


def bench_local(args, backends: list[str]) -> list[dict]:
    model, _ = build_model(args.preset, args.model_dir)
    model = model.to(args.device).eval()
    vocab = model.get_input_embeddings().num_embeddings
    vllm_engines = {}
    rows = []
    for kind, n, slots in SCENARIOS:
        prompts, lengths = prompts_for(kind, n, min(vocab, 50)), lengths_for(kind, n)
        fns = {}
        for name in backends:
            if name == "vllm":
                if slots not in vllm_engines:
                    vllm_engines[slots] = VLLMEngine(args.model_dir, max_batch=slots,
                                                     entropy_logprobs=1,
                                                     max_model_len=256)
                eng = vllm_engines[slots]
                fns[name] = lambda eng=eng: run_vllm(eng, prompts, lengths, slots)
            else:
                run = run_builtin if name == "builtin" else run_hf
                fns[name] = lambda run=run: run(model, prompts, lengths, slots)
        for name, (rate, tokens) in measure(fns, args.repeats).items():
            rows.append(dict(scenario=kind, requests=n, slots=slots, backend=name,
                             tokens=tokens, tokens_per_s=round(rate, 1)))
            if not args.json:
                print(f"  {kind:9s} {n:4d} req / {slots:3d} slots  {name:8s} {rate:9.0f} tok/s",
                      file=sys.stderr)
    return rows


def bench_vllm_subprocess(args, python: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_model(args.preset, args.model_dir)
        models.save(model, tok, Path(tmp) / "model")
        cmd = [python, "-m", "rollwise.bench.engine", "--json", "--backends", "vllm",
               "--model-dir", str(Path(tmp) / "model"), "--repeats", str(args.repeats)]
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                      "1")}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"vLLM run failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            return []
        return json.loads(out.stdout.strip().splitlines()[-1])["rows"]


def table(rows: list[dict]) -> str:
    keyed = {}
    for r in rows:
        keyed.setdefault((r["scenario"], r["requests"], r["slots"]), {})[r["backend"]] = r
    lines = ["| scenario | requests / slots | built-in tok/s | HF generate tok/s | vLLM tok/s | "
             "built-in / HF |", "|---|---|---|---|---|---|"]
    for (kind, n, slots), by in keyed.items():
        def cell(b):
            return f"{by[b]['tokens_per_s']:.0f}" if b in by else "-"
        ratio = by["builtin"]["tokens_per_s"] / by["hf"]["tokens_per_s"] \
            if "builtin" in by and "hf" in by else float("nan")
        lines.append(f"| {kind} | {n} / {slots} | {cell('builtin')} | {cell('hf')} | "
                     f"{cell('vllm')} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--preset", choices=["tiny", "0.5b"], default="tiny")
    ap.add_argument("--model-dir", default=None, help="a local HF model folder instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="builtin,hf,vllm")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                    help="the vLLM environment's python (skipped if missing)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    local = [b for b in backends if b != "vllm" or args.model_dir]
    rows = bench_local(args, local)
    if "vllm" in backends and not args.model_dir:
        if Path(args.vllm_python).exists():
            rows += bench_vllm_subprocess(args, args.vllm_python)
        elif not args.json:
            print(f"vLLM skipped: no {args.vllm_python} (bash scripts/setup_vllm.sh)",
                  file=sys.stderr)
    result = dict(benchmark="engine", preset=args.preset, device=args.device,
                  threads=torch.get_num_threads(), repeats=args.repeats, rows=rows)
    print(json.dumps(result) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
