"""The update's speed on a real model, beside the machine's matrix peak (bench roofline).

    rollwise bench trainer --config smollm2 --threads 2 [--json]
        [--arms fp32,bf16,bf16+ckpt,fp32+mb2048] [--repeats 3]

One GRPO batch shaped like the config's step (control.prompts_per_step groups of
generate.group_size, the task's own prompts, responses of --response-len tokens on average,
long-tailed), the same batch for every arm, through Trainer.update: the old-log-prob pass and
the gradient steps. An arm is a dtype (fp32: float32 parameters; bf16: bfloat16 parameters with
float32 master weights and optimizer) with options: +ckpt (gradient checkpointing), +mbN
(train.max_tokens_per_microbatch = N; +unbounded: None; the default is 'auto'), +nopack
(train.pack_prompts off), +full (the full logits: train.chunked_logits off), +loopopt (AdamW's
per-tensor loop and per-tensor master copies instead of the fused and foreach kernels);
checkpointing is off
unless the arm names it, whatever the config sets. Each arm runs in its
own process (peak memory is per process), warm-up update first, then the median of --repeats.

Reported per arm: trained tokens/s (prompt and response tokens through the passes), the
achieved FLOP/s by the model's count (6 x Linear weights + attention per token for the gradient
pass, a third of that for the log-prob pass) and its share of the matrix peak in the arm's
dtype, peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from rollwise.bench import roofline


def arm_settings(arm: str) -> tuple[torch.dtype, dict]:
    """'bf16+ckpt+mb2048' -> (torch.bfloat16, TrainConfig overrides)."""
    name, *options = arm.split("+")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"arm {arm!r}: start with fp32 or bf16")
    extra: dict = {"gradient_checkpointing": False}  # the arm's own, not the config's
    for opt in options:
        if opt == "ckpt":
            extra["gradient_checkpointing"] = True
        elif opt == "nopack":
            extra["pack_prompts"] = False
        elif opt == "full":
            extra["chunked_logits"] = False
        elif opt == "unbounded":
            extra["max_tokens_per_microbatch"] = None
        elif opt == "loopopt":
            extra["loop_optimizer"] = True  # not a setting: run_arm swaps the kernels
        elif opt.startswith("mb") and opt[2:].isdigit():
            extra["max_tokens_per_microbatch"] = int(opt[2:])
        else:
            raise ValueError(f"arm {arm!r}: unknown option {opt!r} "
                             f"(ckpt, nopack, full, loopopt, unbounded, mbN)")
    return dtypes[name], extra


@contextmanager
def loop_optimizer():
    """Within the block, new trainers step AdamW tensor by tensor and copy masters one at a
    time (the kernels before the fused and foreach ones), to measure what those save."""
    from rollwise.training import precision
    from rollwise.training import trainer as trainer_module
    saved = trainer_module.adamw_kernel, precision._foreach_copy
    trainer_module.adamw_kernel = lambda params: {"foreach": False, "fused": False}
    precision._foreach_copy = lambda dst, src: [d.copy_(s) for d, s in zip(dst, src)]
    try:
        yield
    finally:
        trainer_module.adamw_kernel, precision._foreach_copy = saved


def batch(cfg, tokenizer, response_len: int, seed: int = 0) -> list:
    """The config's step of groups: its task's prompts, long-tailed response lengths with
    this mean, random response tokens, rewards that vary within each group."""
    from rollwise.bench.engine import task_prompts
    from rollwise.types import Group, Sample
    rng = random.Random(seed)
    n, k = cfg.control.prompts_per_step, cfg.generate.group_size
    vocab = len(tokenizer)
    groups = []
    for i, prompt in enumerate(task_prompts(cfg, tokenizer, n)):
        samples = []
        for j in range(k):
            length = max(4, min(4 * response_len, int(rng.expovariate(1 / response_len))))
            resp = [rng.randrange(3, vocab) for _ in range(length)]
            samples.append(Sample(prompt_id=str(i), prompt_ids=prompt, response_ids=resp,
                                  logprobs=[-5.0] * length, versions=[0] * length,
                                  loss_mask=[1] * length, reward=float(j % 2)))
        groups.append(Group(str(i), samples))
    return groups


def flops_of(model, groups, packed: bool) -> float:
    """The update's FLOPs by the model's count: 4 passes' worth (1 log-prob, 3 gradient)."""
    total = 0.0
    for g in groups:
        prompt = len(g.samples[0].prompt_ids)
        for i, s in enumerate(g.samples):
            n = len(s.response_ids) + (0 if packed and i else prompt)
            context = (prompt + len(s.response_ids)) / 2
            total += n * roofline.train_flops_per_token(model, context) * 4 / 3
    return total


def run_arm(args) -> dict:
    from rollwise import models
    from rollwise.config import TrainConfig, load_config
    from rollwise.training.trainer import Trainer
    torch.set_num_threads(args.threads)
    dtype, extra = arm_settings(args.arm)
    if extra.pop("loop_optimizer", False):
        loop_optimizer().__enter__()  # for the rest of this arm's process
    cfg = load_config(args.config, [f"model.dtype={str(dtype).removeprefix('torch.')}"])
    model, tok = models.build(cfg.model)  # loaded in the arm's dtype, not the config's
    train_cfg = TrainConfig(**{**cfg.train.model_dump(),
                               "correction": {"snapshots": 0}, "kl_coef": 0.0, **extra})
    trainer = Trainer(model, train_cfg, pad_id=tok.pad_token_id or 0)
    groups = batch(cfg, tok, args.response_len)
    trainer.update(groups)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = trainer.update(groups)
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = sum(len(s.response_ids) + len(s.prompt_ids) for g in groups for s in g.samples)
    flops = flops_of(model, groups, train_cfg.pack_prompts)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return {"arm": args.arm, "dtype": str(dtype).removeprefix("torch."),
            "seconds_per_update": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
            "flops_per_s": flops / sec, "peak_rss_gib": rss, "loss": m.get("train/loss")}


def table(rows: list[dict]) -> str:
    lines = ["| arm | s / update | tokens/s | GFLOP/s | of the dtype's peak | peak RSS |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['seconds_per_update']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['flops_per_s'] / 1e9:.0f} | {r['of_peak']:.0%} | "
                     f"{r['peak_rss_gib']:.1f} GiB |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench trainer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--arms", default="fp32,bf16,bf16+ckpt")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in this process
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args)))
        return 0
    rows = []
    for arm in args.arms.split(","):
        arm_settings(arm)  # a bad arm fails here, before any run
        cmd = [sys.executable, "-m", "rollwise.bench.trainer", "--config", args.config,
               "--arm", arm, "--response-len", str(args.response_len), "--repeats",
               str(args.repeats), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
            rows.append({"arm": arm, "error": why[:300] + (" (killed: out of memory?)"
                                                           if out.returncode < 0 else "")})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not args.json:
            print(f"  {arm}: {rows[-1].get('tokens_per_s', 0):.0f} tokens/s", file=sys.stderr)
    torch.set_num_threads(args.threads)
    peaks = roofline.measure()  # once, on a quiet process: every arm against the same limits
    for r in rows:
        if "error" not in r:
            r["peak_flops"] = peaks["flops"][r["dtype"]]
            r["of_peak"] = r["flops_per_s"] / r["peak_flops"]
    result = {"benchmark": "trainer", "config": args.config, "threads": args.threads,
              "response_len": args.response_len, "roofline": peaks, "rows": rows}
    print(json.dumps(result) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
