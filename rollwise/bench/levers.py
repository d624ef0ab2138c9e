"""The update's levers measured side by side in one process, alternating, on a real model's
shapes: where whole updates in separate processes are too noisy to split a few seconds.

    rollwise bench levers --config configs/smollm2.yaml [--tokens 7000] [--repeats 5] [--json]

- head: log-probabilities and entropies of --tokens response tokens from the last hidden
  states, forward and backward (gradients of the hidden states and the head's weight),
  through the full logits against the chunked head (rollwise.training.head).
- optimizer: one step on the model's parameters as the trainer takes it (bf16 parameters:
  gradients to the fp32 masters, AdamW, masters back to the model), AdamW's per-tensor loop
  and per-tensor copies against the fused kernel and foreach copies.

Each lever's two arms alternate --repeats times after a warm-up; medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rollwise.training.head import chunk_tokens, head_logprobs
from rollwise.training.precision import MasterWeights, adamw_kernel


def full_head(hidden, weight, target):
    lp = torch.nn.functional.linear(hidden, weight).float().log_softmax(-1)
    return lp.gather(-1, target[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def head_arms(model, tokens: int) -> dict:
    weight = model.get_output_embeddings().weight.detach().requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, weight.shape[1], generator=g).to(weight.dtype)
    hidden.requires_grad_(True)
    target = torch.randint(0, weight.shape[0], (tokens,), generator=g)
    chunk = chunk_tokens(weight.shape[0])

    def run(fn):
        def once():
            lp, ent = fn(hidden, weight, target)
            (lp.sum() + 0.01 * ent.sum()).backward()
            hidden.grad = weight.grad = None
        return once
    return {"full logits": run(full_head),
            "chunked": run(lambda h, w, t: head_logprobs(h, w, None, t, chunk, True))}


def optimizer_arms(model) -> dict:
    master = MasterWeights.of(model)
    params = master.params() if master else [p for p in model.parameters() if p.requires_grad]
    loop = torch.optim.AdamW(params, lr=1e-6, foreach=False, fused=False)
    fast = torch.optim.AdamW(params, lr=1e-6, **adamw_kernel(params))
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters() if p.requires_grad]

    def step(optimizer, copy):
        def once():
            for p, g in zip((p for p in model.parameters() if p.requires_grad), grads):
                p.grad = g.clone()
            if master:
                copy_to_master(master, copy)
            optimizer.step()
            if master:
                with torch.no_grad():
                    copy(*zip(*master.pairs))  # (model params, masters)
        return once
    per_tensor = lambda dst, src: [d.copy_(s) for d, s in zip(dst, src)]  # noqa: E731
    return {"per-tensor AdamW and copies": step(loop, per_tensor),
            "fused AdamW, foreach copies": step(fast, torch._foreach_copy_)}


def copy_to_master(master: MasterWeights, copy) -> None:
    """grads_to_master with the given copy (the per-tensor one allocates, as before)."""
    if copy is torch._foreach_copy_:
        master.grads_to_master()
        return
    for p, m in master.pairs:
        m.grad = p.grad.float()
        p.grad = None


def alternate(arms: dict, repeats: int) -> dict:
    for fn in arms.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    (a, ta), (b, tb) = times.items()
    return {"seconds": {a: statistics.median(ta), b: statistics.median(tb)},
            "all": times, "speedup": statistics.median(ta) / statistics.median(tb)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench levers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokens", type=int, default=7000, help="response tokens of the head arm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from rollwise import models
    from rollwise.config import load_config
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model, _ = models.build(cfg.model)
    model.requires_grad_(True)
    out = {"benchmark": "levers", "config": args.config, "dtype": str(model.dtype),
           "tokens": args.tokens, "threads": args.threads,
           "head": alternate(head_arms(model, args.tokens), args.repeats),
           "optimizer": alternate(optimizer_arms(model), args.repeats)}
    if args.json:
        print(json.dumps(out))
    else:
        for lever in ("head", "optimizer"):
            (a, ta), (b, tb) = out[lever]["seconds"].items()
            print(f"{lever}: {a} {ta:.3f} s, {b} {tb:.3f} s: {out[lever]['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
