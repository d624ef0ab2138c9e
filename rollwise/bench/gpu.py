"""GPU benchmark: generation and training on a Qwen2.5-0.5B-shaped model with random weights
(built from a config, nothing downloaded), each beside the device's roofline.

    rollwise bench gpu --json                       # on a CUDA machine
    rollwise bench gpu --device cpu --preset tiny   # the same code on a CPU, small (a check)

Generation: decode tokens/s of the built-in engine, HF `generate` and vLLM (when importable in
this environment) at 64 and 256 concurrent sequences, every request forced to --new-tokens
(no stop ids), against the bandwidth roofline: each decode step reads every weight once and
each sequence's K/V, so tokens/s <= B * bandwidth / (weight bytes + B * KV bytes at the mean
context). Training: rollwise's Trainer.update on synthetic groups at bf16 (fp32 master weights),
activation checkpointing off and on: tokens/s, model FLOP utilisation (6N + attention FLOPs per
trained token, 2N + attention per token of the old-log-prob pass, over the peak) and peak memory.
Peaks: the vendor's dense bf16 FLOP/s and memory bandwidth for known devices, and both measured
here (a large bf16 matmul, a device-to-device copy); MFU is against the vendor peak where known.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time

import torch

from rollwise import models
from rollwise.bench import roofline

# measure: warm-up, then backends timed in turn, medians
from rollwise.bench.engine import measure
from rollwise.config import TrainConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.vllm import VLLMEngine
from rollwise.training.trainer import Trainer
from rollwise.types import Group, Sample

# dense bf16 FLOP/s and memory bytes/s by device name (vendor data sheets)
PEAKS = {"H100 SXM": (989e12, 3.35e12), "H100 NVL": (835e12, 3.9e12),
         "H100 PCIe": (756e12, 2.0e12), "H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12),
         "A100-SXM4-80GB": (312e12, 2.04e12), "A100": (312e12, 1.555e12),
         "L40S": (362e12, 0.864e12), "L4": (121e12, 0.3e12), "RTX 4090": (165e12, 1.008e12)}


def model_config(preset: str):
    """A model's shape with random weights: Qwen2.5-0.5B's, SmolLM2-135M's, or a tiny one."""
    from transformers import LlamaConfig, Qwen2Config
    if preset == "0.5b":  # Qwen2.5-0.5B's shape
        return Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, max_position_embeddings=4096,
                           tie_word_embeddings=True)
    if preset == "smollm2":  # SmolLM2-135M's shape
        return LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                           max_position_embeddings=8192, tie_word_embeddings=True)
    return Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                       tie_word_embeddings=True)


def build(preset: str, device: str, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(preset)).to(device, dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_peaks(device: str) -> dict:
    """Vendor peaks where the device is known, and both measured here (bench roofline)."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    vendor = next((v for k, v in PEAKS.items() if k in name), (None, None))
    flops = roofline.matmul_rate(torch.bfloat16 if device.startswith("cuda") else torch.float32,
                                 device, n=None if device.startswith("cuda") else 512)
    bw = roofline.bandwidth(device, None if device.startswith("cuda") else 2 ** 26)
    return {"device_name": name, "vendor_flops": vendor[0], "vendor_bandwidth": vendor[1],
            "measured_flops": flops, "measured_bandwidth": bw,
            "flops": vendor[0] or flops, "bandwidth": vendor[1] or bw}


# ----------------------------------------------------------------------------- generation

def gen_inputs(n: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (n, prompt_len), generator=g).tolist()


def run_builtin(model, prompts, new_tokens: int | list[int], graph: str = "off") -> int:
    """The built-in engine, every request forced to its length (one for all, or one each):
    graph="off" is its eager path, "compile" its decode graph (CUDA graphs on a GPU)."""
    lengths = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    engine = BuiltinEngine(model, max_batch=len(prompts), copy_model=False, graph=graph)
    reqs = [Request(x, SamplingParams(temperature=1.0, max_new_tokens=n, stop_ids=()), i)
            for i, (x, n) in enumerate(zip(prompts, lengths))]
    return sum(len(c.token_ids) for c in engine.generate(reqs))


def run_graph(model, prompts, new_tokens: int | list[int]) -> int:
    return run_builtin(model, prompts, new_tokens, graph="compile")


CB_BLOCK = 32  # tokens a block of transformers' paged cache holds


def hf_continuous_batching(model):
    """transformers' own continuous batching (`generate_batch`: paged attention, CUDA graphs
    where this version has them) as run(prompts, new_tokens) -> tokens, or the reason it
    cannot run here. Its requests stop at an end token: none is set, so each runs to
    new_tokens (one length for all)."""
    if not hasattr(model, "generate_batch"):
        return None, "this transformers has no generate_batch"
    import inspect

    from transformers import GenerationConfig

    def run(prompts, new_tokens: int) -> int:
        # Its paged cache is otherwise sized by the memory free (14-17 GB of host memory for
        # the tiny model on a CPU): give it the blocks these requests need.
        longest = max(len(p) for p in prompts) + new_tokens
        cache = {"block_size": CB_BLOCK, "num_blocks": len(prompts) * (-(-longest // CB_BLOCK) + 1)}
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, eos_token_id=None,
                               pad_token_id=0, use_cuda_graph=True, **cache)
        kwargs = {}
        if "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                use_cuda_graph=model.device.type == "cuda", **cache)
        with torch.inference_mode():
            out = model.generate_batch(prompts, generation_config=gen, **kwargs)
        return sum(len(o.generated_tokens) for o in out.values())
    return run, None


@torch.inference_mode()
def run_hf(model, prompts, new_tokens: int) -> int:
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                         eos_token_id=None)
    return (out.shape[1] - ids.shape[1]) * len(prompts)


def vllm_runner(model, tmp: str, max_seqs: int, max_len: int):
    """vLLM on a saved copy (None when vLLM is not importable here)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    models.save(model, models.char_tokenizer(), f"{tmp}/model")
    extra = {"gpu_memory_utilization": 0.8} if torch.cuda.is_available() else {}
    engine = VLLMEngine(f"{tmp}/model", max_batch=max_seqs, dtype="bfloat16",
                        entropy_logprobs=1, max_model_len=max_len, **extra)

    def run(prompts, new_tokens):
        p = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_ids=())
        return sum(len(c.token_ids) for c in engine.generate(
            [Request(x, p, i) for i, x in enumerate(prompts)]))
    return run


def decode_roofline(model, peaks: dict, batch: int, prompt_len: int, new_tokens: float
                    ) -> float:
    """The bandwidth bound alone (a GPU's decode is memory-bound): roofline.decode_bound's
    memory side at the mean context."""
    step = roofline.decode_bytes_per_step(model, batch, prompt_len + new_tokens / 2,
                                          model.dtype)
    return batch * peaks["bandwidth"] / step


def tail_lengths(n: int, new_tokens: int) -> list[int]:
    """A long-tail RL profile with the same cap: geometric lengths with median new_tokens / 5,
    1 in 10 run to the cap (bench engine's rl longtail, scaled)."""
    from rollwise.bench.engine import _geometric
    rng = random.Random(0)
    return [new_tokens if rng.random() < 0.1 else min(new_tokens, _geometric(rng, max(
        1, new_tokens // 5))) for _ in range(n)]


def bench_generation(args, model, peaks) -> list[dict]:
    """Decode tokens/s of each backend on equal lengths (every sequence --new-tokens) and on a
    long tail (the same cap), against the bandwidth roofline at the mean context."""
    rows = []
    vocab = model.config.vocab_size
    cb, cb_missing = hf_continuous_batching(model)
    with tempfile.TemporaryDirectory() as tmp:
        vllm_run = vllm_runner(model, tmp, max(args.seqs), args.prompt_len + args.new_tokens)
        for n in args.seqs:  # the long tail at the largest batch only (the check's time)
            prompts = gen_inputs(n, args.prompt_len, vocab)
            for profile_name in ("equal", "longtail")[:2 if n == max(args.seqs) else 1]:
                rows += _generation_rows(args, model, peaks, prompts, profile_name, cb,
                                         cb_missing, vllm_run)
    return rows


def _generation_rows(args, model, peaks, prompts, profile_name, cb, cb_missing, vllm_run):
    n = len(prompts)
    lengths = [args.new_tokens] * n if profile_name == "equal" else \
        tail_lengths(n, args.new_tokens)
    fns = {"graph": lambda: run_graph(model, prompts, lengths),
           "builtin": lambda: run_builtin(model, prompts, lengths)}
    skipped = {}
    if profile_name == "equal":  # one length for all: what these peers can force
        fns["hf"] = lambda: run_hf(model, prompts, args.new_tokens)
        if cb is not None:
            fns["hf_cb"] = lambda: cb(prompts, args.new_tokens)
        else:
            skipped["hf_cb"] = cb_missing
        if vllm_run is not None:
            fns["vllm"] = lambda: vllm_run(prompts, args.new_tokens)
        else:
            skipped["vllm"] = "vllm is not importable in this environment"
    mean_new = sum(lengths) / n
    roof = decode_roofline(model, peaks, n, args.prompt_len, mean_new)
    timed, errors = {}, {}
    for name, fn in fns.items():
        timed[name] = synced(fn, args.device)
    warm: dict[str, float] = {}
    rows = []
    try:
        results = measure(timed, args.repeats, warmup_seconds=warm)
    except Exception as e:  # a peer that fails here is reported, the rest measured alone
        errors = {"error": f"{type(e).__name__}: {e}"}
        results = {}
        for name, fn in timed.items():
            try:
                results.update(measure({name: fn}, args.repeats, warmup_seconds=warm))
            except Exception as inner:
                skipped[name] = f"{type(inner).__name__}: {inner}"
    for name, (rate, _) in results.items():
        rows.append({"part": "generate", "profile": profile_name, "backend": name,
                     "sequences": n, "tokens_per_s": rate, "roofline_tokens_per_s": roof,
                     "of_roofline": rate / roof, "warmup_s": warm.get(name), **errors})
    for name, why in skipped.items():
        rows.append({"part": "generate", "profile": profile_name, "backend": name,
                     "sequences": n, "skipped": why})
    return rows


def synced(fn, device: str):
    """fn, finishing the device's queued work before and after, so a timer around it is true."""
    def run():
        sync(device)
        out = fn()
        sync(device)
        return out
    return run


# ------------------------------------------------------------------------------- training

def synthetic_groups(n_groups: int, group_size: int, prompt_len: int, response_len: int,
                     vocab: int) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n_groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        samples = []
        for j in range(group_size):
            resp = torch.randint(3, vocab, (response_len,), generator=g).tolist()
            samples.append(Sample(prompt_id=str(i), prompt_ids=prompt, response_ids=resp,
                                  logprobs=[-5.0] * response_len, versions=[0] * response_len,
                                  loss_mask=[1] * response_len, reward=float(j % 2)))
        out.append(Group(str(i), samples))
    return out


# The update's levers, each row adding one to the one before: the full logits and AdamW's
# per-tensor loop (as before either existed), the chunked head, the fused optimizer and foreach
# master copies (the defaults), then gradient checkpointing on top.
TRAIN_ARMS = [("full logits, loop AdamW", {"chunked_logits": False}, True),
              ("chunked logits, loop AdamW", {}, True),
              ("chunked logits, fused AdamW", {}, False),
              ("chunked, fused, checkpointing", {"gradient_checkpointing": True}, False)]


def bench_training(args, peaks) -> list[dict]:
    from rollwise.bench.trainer import loop_optimizer
    rows = []
    for name, settings, loop_adamw in TRAIN_ARMS:
        model = build(args.preset, args.device)
        cfg = TrainConfig(**{"minibatches": 1, "gradient_checkpointing": False,
                             "max_tokens_per_microbatch": args.microbatch_tokens, "lr": 1e-6,
                             **settings})
        with loop_optimizer() if loop_adamw else contextlib.nullcontext():
            trainer = Trainer(model, cfg, pad_id=0)
        groups = synthetic_groups(args.train_groups, 8, args.prompt_len, args.response_len,
                                  model.config.vocab_size)
        trainer.update(groups)  # warm-up (allocator, kernels)
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            sync(args.device)
            t = time.perf_counter()
            trainer.update(groups)
            sync(args.device)
            times.append(time.perf_counter() - t)
        sec = statistics.median(times)
        L, d = model.config.num_hidden_layers, model.config.hidden_size
        T = args.prompt_len + args.response_len
        # causal attention: ~T/2 keys
        per_token_fwd = 2 * roofline.linear_weights(model) + 2 * L * T * d
        # packing (train.pack_prompts) holds a group's prompt once in the passes
        tokens = args.train_groups * (args.prompt_len + 8 * args.response_len)
        flops = 4 * per_token_fwd * tokens  # old-log-prob pass (1x) + trained pass (3x)
        peak_mem = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
        rows.append({"part": "train", "arm": name,
                     "gradient_checkpointing": cfg.gradient_checkpointing,
                     "chunked_logits": cfg.chunked_logits, "fused_adamw": not loop_adamw,
                     "tokens_per_s": tokens / sec, "seconds_per_update": sec,
                     "mfu": flops / sec / peaks["flops"], "peak_memory_gib":
                     None if peak_mem is None else peak_mem / 2 ** 30})
        del trainer, model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def table(result: dict) -> str:
    lines = ["| part | setting | tokens/s | roofline or peak | share |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append(f"| generate | {r['backend']} @ {r['sequences']} | not run: "
                         f"{r['skipped']} | | |")
        elif r["part"] == "generate":
            lines.append(f"| generate {r.get('profile', 'equal')} | {r['backend']} @ "
                         f"{r['sequences']} seqs | {r['tokens_per_s']:.0f} | "
                         f"{r['roofline_tokens_per_s']:.0f} tok/s | "
                         f"{r['of_roofline']:.1%} of bandwidth roofline |")
        else:
            mem = "" if r["peak_memory_gib"] is None else f", peak {r['peak_memory_gib']:.1f} GiB"
            lines.append(f"| train | bf16, {r['arm']} | "
                         f"{r['tokens_per_s']:.0f} | | MFU {r['mfu']:.1%}{mem} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rollwise bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", choices=["0.5b", "smollm2", "tiny"], default="0.5b")
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--train-groups", type=int, default=4, help="groups of 8 per update")
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-generate", action="store_true", help="training rows only")
    ap.add_argument("--no-train", action="store_true", help="generation rows only")
    return ap


def run(args, peaks: dict | None = None) -> dict:
    """The benchmark's result for parsed arguments (peaks measured unless given)."""
    peaks = peaks or device_peaks(args.device)
    rows = []
    if not args.no_generate:
        model = build(args.preset, args.device)
        rows += bench_generation(args, model, peaks)
        del model
    if not args.no_train:
        rows += bench_training(args, peaks)
    return {"benchmark": "gpu", "preset": args.preset, **peaks, "rows": rows}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("rollwise bench gpu: no CUDA device here; run it on a GPU machine, or pass "
              "--device cpu --preset tiny to check the code path", file=sys.stderr)
        return 2
    result = run(args)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
