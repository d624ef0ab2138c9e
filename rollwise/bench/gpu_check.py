"""The GPU check: what rollwise has never run on a GPU, in one command that writes one JSON.

    bash scripts/gpu_check.sh [OUT.json]              # one NVIDIA GPU; no network, no vLLM
    python -m rollwise.bench.gpu_check --device cpu --tiny --out check.json   # CI: the same code

Parts, each timed; one that fails is recorded with its error and the others still run (the
JSON is rewritten after each, so a run cut short keeps what finished):
  decode     `rollwise bench gpu`'s generation at SmolLM2-135M's and Qwen2.5-0.5B's shapes
             (random weights built from a config): the decode graph (compiled, CUDA graphs),
             the eager engine, HF `generate` and transformers' continuous batching, equal
             lengths and a long tail, beside the bandwidth roofline; then the decode graph's
             host launches per decode pass and its compile-and-capture time
  bench_gpu  `rollwise bench gpu`'s training rows (the update beside the device's peak)
  train      20 steps of the default run with run.device set; on a GPU it must learn
             (held-out pass@1 rises)
  fsdp2      one update of the FSDP2 trainer (train.world_size=1, NCCL) against the plain
             Trainer's on the same model and batch: the same weights after it
  profile    where the time goes (torch.profiler) in the built-in engine's decode, HF
             `generate`'s and one update at SmolLM2's shape: wall time against the time the
             device's kernels ran, the number of kernels launched, the costliest operators
--tiny shrinks every part (the tiny model, a few tokens, 2 steps) to keep its code path alive
on a CPU; it asserts nothing about learning. Exit 0 when every part passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

TINY_RUN = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
            "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
            "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=2",
            "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
            "run.threads=1", "filter.workers=0"]


def decode(device: str, tiny: bool) -> dict:
    """`bench gpu`'s generation rows at SmolLM2's and Qwen2.5-0.5B's shapes (the decode graph,
    the eager engine, HF generate and transformers' continuous batching; equal lengths and a
    long tail), then the decode graph's host launches per decode step."""
    from rollwise.bench import gpu
    if tiny:
        argv = [["--preset", "tiny", "--seqs", "2,4", "--new-tokens", "6", "--prompt-len", "6",
                 "--repeats", "1", "--no-train"]]
    else:
        argv = [["--preset", p, "--repeats", "1", "--no-train"] for p in ("smollm2", "0.5b")]
    peaks = gpu.device_peaks(device)
    out = {a[1]: gpu.run(gpu.parser().parse_args(["--device", device, *a]), peaks)
           for a in argv}
    out["launches"] = decode_launches(device, tiny)
    return out


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def decode_launches(device: str, tiny: bool) -> dict:
    """Host calls that start device work (kernel launches, graph launches, copies) per decode
    pass of the decode graph, once its graphs are captured: SmolLM2's shape, 64 sequences."""
    from torch.profiler import ProfilerActivity, profile

    from rollwise.bench import gpu
    from rollwise.engine import BuiltinEngine, Request, SamplingParams
    preset, n, prompt_len, new = ("tiny", 4, 8, 8) if tiny else ("smollm2", 64, 128, 64)
    model = gpu.build(preset, device)
    prompts = gpu.gen_inputs(n, prompt_len, model.config.vocab_size)
    engine = BuiltinEngine(model, max_batch=n, copy_model=False, graph="compile")
    reqs = [Request(p, SamplingParams(temperature=1.0, max_new_tokens=new), i)
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    engine.generate(reqs)  # compiles and captures
    first = time.perf_counter() - t
    passes = engine.forward_passes
    gpu.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        engine.generate(reqs)
        gpu.sync(device)
        wall = time.perf_counter() - t
    passes = engine.forward_passes - passes
    events = prof.key_averages()
    calls = {e.key: e.count for e in events if e.key in LAUNCHES}
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"shape": {"preset": preset, "sequences": n, "prompt_len": prompt_len,
                      "new_tokens": new},
            "first_run_s": first, "profiled_wall_s": wall, "forward_passes": passes,
            "graph_captures": engine.graph.captures if engine.graph else None,
            "capture_note": engine.graph.capture_note if engine.graph else None,
            "host_launch_calls": calls,
            "host_launches_per_pass": sum(calls.values()) / passes if device != "cpu" else None,
            "device_kernels_per_pass": kernels / passes if device != "cpu" else None}


def bench_gpu(device: str, tiny: bool) -> dict:
    """`bench gpu`'s training rows at SmolLM2's and Qwen2.5-0.5B's shapes."""
    from rollwise.bench import gpu
    if tiny:
        argv = [["--preset", "tiny", "--response-len", "8", "--prompt-len", "6",
                 "--train-groups", "2", "--repeats", "1", "--microbatch-tokens", "64",
                 "--no-generate"]]
    else:
        argv = [["--preset", p, "--repeats", "2", "--no-generate"] for p in ("smollm2", "0.5b")]
    peaks = gpu.device_peaks(device)
    return {a[1]: gpu.run(gpu.parser().parse_args(["--device", device, *a]), peaks)
            for a in argv}


def train(device: str, tiny: bool) -> dict:
    import rollwise
    from rollwise.config import load_config
    with tempfile.TemporaryDirectory() as root:
        overrides = [f"run.device={device}", f"run.root={root}", "run.name=gpu-check",
                     "run.log=quiet", "run.report=false", "run.tensorboard=false"]
        overrides += TINY_RUN if tiny else ["train.steps=20", "run.eval_every=10"]
        t = time.perf_counter()
        summary = rollwise.train(load_config(None, overrides))
        seconds = time.perf_counter() - t
    start, end = summary["eval_pass1_start"], summary["eval_pass1_end"]
    if not tiny and end <= start:
        raise AssertionError(f"the default run did not learn on {device}: held-out pass@1 "
                             f"{start:.3f} -> {end:.3f} in 20 steps")
    return {"steps": summary.get("steps"), "eval_pass1_start": start, "eval_pass1_end": end,
            "wall_seconds": seconds}


def fsdp2(device: str, tiny: bool) -> dict:
    """FSDP2 over one rank (NCCL on a GPU, gloo on a CPU) against the plain Trainer."""
    from rollwise.bench import gpu
    from rollwise.config import TrainConfig
    from rollwise.training.sharded import ShardedTrainer
    from rollwise.training.trainer import Trainer
    model = gpu.build("tiny" if tiny else "smollm2", "cpu", torch.float32)
    cfg = TrainConfig(lr=1e-4, minibatches=1, kl_coef=0.0, correction={"snapshots": 0})
    groups = gpu.synthetic_groups(2, 4, 8, 16 if tiny else 128, model.config.vocab_size)
    plain = Trainer(copy.deepcopy(model).to(device), cfg, pad_id=0, seed=0)
    sharded = ShardedTrainer(copy.deepcopy(model), cfg, pad_id=0, seed=0, world_size=1,
                             timeout_s=300)
    try:
        a, b = plain.update(groups), sharded.update(groups)
        moved = max(float((w.cpu() - model.state_dict()[k]).abs().max())
                    for k, w in plain.weights().items())
        gap = max(float((w.cpu() - sharded.weights()[k].cpu()).abs().max())
                  for k, w in plain.weights().items())
    finally:
        sharded.close()
    if not gap < 0.1 * moved:
        raise AssertionError(f"FSDP2's update differs from the plain trainer's by {gap:.2e} "
                             f"(the update itself moved weights by {moved:.2e})")
    return {"loss_plain": a["train/loss"], "loss_fsdp2": b["train/loss"],
            "max_weight_gap": gap, "max_weight_change": moved}


def profiled(fn, device: str) -> dict:
    """fn run once under torch.profiler (after a warm-up run): wall seconds, seconds the
    device's kernels ran (None on a CPU) and how many launched, and the costliest operators."""
    from torch.profiler import ProfilerActivity, profile

    from rollwise.bench import gpu
    cuda = device.startswith("cuda")
    fn()
    gpu.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        gpu.sync(device)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 if cuda else None
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted((e for e in events if e.key.startswith("aten::")),
                 key=lambda e: getattr(e, key), reverse=True)[:8]
    return {"wall_s": wall, "device_busy_s": busy,
            "device_busy_share": None if busy is None else busy / wall,
            "kernel_launches": sum(e.count for e in kernels) if cuda else None,
            "top_ops": [{"op": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3}
                        for e in top]}


def profile(device: str, tiny: bool) -> dict:
    """Is the device kept busy? Decode of 64 sequences × 32 tokens (built-in and HF) and one
    update of 2 groups × 8 × 512 tokens, SmolLM2's shape in bf16 (the tiny model: a few), with
    the update's levers (chunked logits, fused AdamW) and without, with packed rows attended
    through the dense mask instead of by segments, and with the blocks' norms and MLPs
    compiled (train.compile_blocks).
    Last of the parts: about two minutes on an H100, most of it the profiler's own cost."""
    from rollwise.bench import gpu
    from rollwise.bench.trainer import loop_optimizer
    from rollwise.config import TrainConfig
    from rollwise.training import packed_attention
    from rollwise.training.trainer import Trainer
    preset, n, prompt_len, new, response_len = (("tiny", 4, 8, 4, 8) if tiny
                                                else ("smollm2", 64, 128, 32, 512))
    model = gpu.build(preset, device)
    prompts = gpu.gen_inputs(n, prompt_len, model.config.vocab_size)
    out = {"builtin_decode": profiled(lambda: gpu.run_builtin(model, prompts, new), device),
           "hf_decode": profiled(lambda: gpu.run_hf(model, prompts, new), device)}
    groups = gpu.synthetic_groups(1 if tiny else 2, 8, prompt_len, response_len,
                                  model.config.vocab_size)
    cfg = TrainConfig(minibatches=1, max_tokens_per_microbatch=16384, lr=1e-6)
    trainer = Trainer(model, cfg, pad_id=0)
    out["train_update"] = profiled(lambda: trainer.update(groups), device)
    del trainer  # packed rows through the dense mask (auto attends them by segments)
    packed_attention.disable(model)
    trainer = Trainer(model, cfg.model_copy(update={"packed_attention": "mask"}), pad_id=0)
    out["train_update_attention_mask"] = profiled(lambda: trainer.update(groups), device)
    del trainer
    packed_attention.disable(model)
    trainer = Trainer(copy.deepcopy(model), cfg.model_copy(update={"compile_blocks": True}),
                      pad_id=0)  # compiled in the warm-up run; the profile is of a later one
    out["train_update_compiled_blocks"] = profiled(lambda: trainer.update(groups), device)
    del trainer
    with loop_optimizer():  # the update without its levers: full logits, AdamW's loop
        trainer = Trainer(model, cfg.model_copy(update={"chunked_logits": False}), pad_id=0)
    out["train_update_without_levers"] = profiled(lambda: trainer.update(groups), device)
    return {"shape": {"preset": preset, "sequences": n, "prompt_len": prompt_len,
                      "new_tokens": new, "update_tokens_per_sample": response_len}, **out}


PARTS = {"decode": decode, "bench_gpu": bench_gpu, "train": train, "fsdp2": fsdp2,
         "profile": profile}


def environment(device: str) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": sys.version.split()[0], "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollwise.bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the CPU check of the code path")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device here; run it on a GPU machine, or use "
              "--device cpu --tiny to check the code path", file=sys.stderr)
        return 2
    result = {"benchmark": "gpu_check", "environment": environment(args.device), "parts": {}}
    for name in args.parts.split(","):
        t = time.perf_counter()
        try:
            part = {"ok": True, **PARTS[name](args.device, args.tiny)}
        except Exception as e:  # recorded; the other parts still run
            part = {"ok": False, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:]}
        part["seconds"] = round(time.perf_counter() - t, 1)
        result["parts"][name] = part
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"gpu_check: {name} {'ok' if part['ok'] else 'FAILED: ' + part['error']} "
              f"({part['seconds']} s)", file=sys.stderr)
    return 0 if all(p["ok"] for p in result["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
