"""The update's levers measured side by side in one process, alternating, on a real model's
shapes: where whole updates in separate processes are too noisy to split a few seconds.

    rollwise bench levers --config smollm2 [--tokens 7000] [--repeats 5] [--json]

- head: log-probabilities and entropies of --tokens response tokens from the last hidden
  states, forward and backward (gradients of the hidden states and the head's weight),
  through the full logits against the chunked head (rollwise.training.head).
- optimizer: one step on the model's parameters as the trainer takes it (bf16 parameters:
  gradients to the fp32 masters, AdamW, masters back to the model), AdamW's per-tensor loop
  and per-tensor copies against the fused kernel and foreach copies.

- loss: the PPO-clip token loss and GRPO's aggregation over --tokens tokens, forward and
  backward, eager against torch.compile'd (the clip metrics eager in both, as the trainer
  needs them); the compile's seconds and the largest difference of the loss are reported.

- attention: one forward and backward pass over packed rows (the trainer's layout: prompts
  of --prompt-tokens, 8 responses each, lengths log-uniform from 16 to generate.max_new_tokens,
  --tokens response tokens in all), the rows attended through their dense (L x L) mask
  against by segments (rollwise.training.packed_attention); the attention scores each
  computes and the largest difference of the log-probabilities are reported.

- layer: the same pass with every decoder layer eager against torch.compile'd (one compiled
  module per layer, shared code), each arm over --layer-batches distinct batches as a run
  changes shapes and layouts from step to step (1: fixed shapes, the best case for a
  compiler).
- parts: the same, each layer's norms and MLP compiled with dynamic shapes instead
  (train.compile_blocks). Reported for both: the compile's seconds (the compiled arm's
  first round less its median one, recompiles included), the graphs compiled, and each arm's
  largest difference from the same pass in float32 (is the compiled rounding worse?).

Each lever's two arms alternate --repeats times after a warm-up; medians and their ratio.
--levers picks some (default: all).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time

import torch

from rollwise.training import packed_attention
from rollwise.training.compiled import compile_block_parts
from rollwise.training.head import chunk_tokens, head_logprobs
from rollwise.training.losses import (
    LossParams,
    _clip_metrics,
    _clipped_surrogate,
    ppo_clip,
    seq_mean_token_mean,
)
from rollwise.training.packing import pack, packed_token_logprobs
from rollwise.training.precision import MasterWeights, adamw_kernel
from rollwise.types import Batch, Sample


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


def loss_arms(tokens: int) -> tuple[dict, dict]:
    """The loss lever's arms, and the compile's seconds and the eager/compiled difference."""
    g = torch.Generator().manual_seed(0)
    rows, width = max(tokens // 64, 1), 64
    logp = (-3 * torch.rand(rows, width, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(rows, width, generator=g)
    adv = torch.randn(rows, generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.1).float()
    weights = torch.ones(rows, width)

    def surrogate(logp, old, adv, mask, weights):
        ratio = torch.exp(logp - old)
        return seq_mean_token_mean(_clipped_surrogate(ratio, adv[:, None], LossParams())
                                   * weights, mask)

    def eager(*a):
        token_loss, _ = ppo_clip(*a[:4])
        return seq_mean_token_mean(token_loss * a[4], a[3])
    compiled = torch.compile(surrogate, dynamic=False)
    args = (logp, old, adv, mask, weights)
    t = time.perf_counter()
    compiled(*args).backward()
    compile_s = time.perf_counter() - t
    logp.grad = None
    gap = float((compiled(*args) - eager(*args)).detach().abs())

    def with_metrics(*a):
        _clip_metrics(torch.exp(a[0].detach() - a[1]), a[2][:, None], a[3], LossParams())
        return compiled(*a)

    def run(fn):
        def once():
            fn(*args).backward()
            logp.grad = None
        return once
    return ({"eager": run(eager), "torch.compile": run(with_metrics)},
            {"compile_seconds": compile_s, "loss_gap": gap, "tokens": rows * width})


def packed_batch(vocab: int, tokens: int, prompt: int, longest: int, seed: int = 0) -> Batch:
    """Groups of 8 responses after a shared prompt, lengths log-uniform on [16, longest],
    until `tokens` response tokens."""
    rng, samples, total = random.Random(seed), [], 0
    while total < tokens:
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        for _ in range(8):
            n = int(16 * math.exp(rng.random() * math.log(max(longest, 16) / 16)))
            samples.append(Sample(prompt_id=str(len(samples) // 8), prompt_ids=ids,
                                  response_ids=[rng.randrange(vocab) for _ in range(n)],
                                  logprobs=[0.0] * n, versions=[0] * n, loss_mask=[1] * n))
            total += n
    return Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)


def attention_arms(model, batch: Batch) -> tuple[dict, dict]:
    packed = pack(batch, fill=True)
    chunk = chunk_tokens(model.get_output_embeddings().weight.shape[0])
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))

    def run(segments: bool):
        def once():
            (packed_attention.enable if segments else packed_attention.disable)(model)
            lp, _ = packed_token_logprobs(model, batch, packed, chunk=chunk)
            (lp * weights * batch.loss_mask).sum().backward()
            model.zero_grad(set_to_none=True)
            return lp.detach()
        return once
    dense, segments = run(False), run(True)
    gap = float((dense() - segments()).abs()[batch.loss_mask > 0].max())
    R, L = packed.input_ids.shape
    lay = packed.layout()
    facts = {"rows": R, "row_tokens": L, "samples": batch.size,
             "dense_scores": R * L * L, "segment_scores": lay.scores,
             "sdpa_calls_per_layer": len(lay.buckets), "logprob_gap": gap}
    return {"dense mask": dense, "segments": segments}, facts


def layer_arms(model, batches: list[Batch], part: str = "block") -> tuple[dict, dict]:
    """The model's packed pass eager against compiled, each arm one pass over every batch
    (distinct batches are a run's changing shapes and layouts): part "block" compiles every
    decoder block whole (static shapes), "parts" each block's norms and MLP with dynamic
    shapes (rollwise.training.compiled, the trainer's train.compile_blocks). Reported: the
    compiled arm's first round's seconds (compiles and recompiles), the graphs Dynamo
    compiled, and each arm's largest log-probability difference from float32."""
    from torch._dynamo.utils import counters
    packed_attention.enable(model)  # the trainer's default where the model attends by SDPA
    packs = [pack(b, fill=True) for b in batches]
    chunk = chunk_tokens(model.get_output_embeddings().weight.shape[0])
    wide = copy.deepcopy(model).float()  # the float32 reference, eager
    layers = model.get_decoder().layers
    eager = list(layers)
    if part == "block":  # swapped into the model's layer list for the fast arm
        fast_model, compiled = model, [torch.compile(layer) for layer in eager]
    else:  # a copy compiled in place: no swapping
        fast_model, compiled = copy.deepcopy(model), None
        compile_block_parts(fast_model)

    def one_pass(m, batch, packed):
        lp, _ = packed_token_logprobs(m, batch, packed, chunk=chunk)
        lp[batch.loss_mask > 0].sum().backward()
        m.zero_grad(set_to_none=True)
        return lp.detach().float()

    def run(m, mods):
        def once():
            for i, mod in enumerate(mods or ()):
                layers[i] = mod
            return [one_pass(m, b, p) for b, p in zip(batches, packs)]
        return once
    plain, fast = run(model, eager), run(fast_model, compiled)
    reference = plain()
    graphs_before = counters["stats"]["unique_graphs"]
    t = time.perf_counter()
    got = fast()  # compiles, and recompiles where a batch's shapes or layout differ
    first_round_s = time.perf_counter() - t
    exact = one_pass(wide, batches[0], packs[0])
    del wide
    scored = batches[0].loss_mask > 0

    def gap(a, b):
        return float((a - b).abs()[scored].max())
    return {"eager": plain, "torch.compile": fast}, {
        "batches": len(batches), "first_round_seconds": first_round_s,
        "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
        "logprob_gap": max(float((r - g).abs()[b.loss_mask > 0].max())
                           for r, g, b in zip(reference, got, batches)),
        "eager_vs_fp32": gap(reference[0], exact), "compiled_vs_fp32": gap(got[0], exact)}


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
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="prompt length of the attention lever's packed rows")
    ap.add_argument("--layer-batches", type=int, default=4,
                    help="distinct batches (shapes, layouts) the layer lever passes over")
    ap.add_argument("--levers", default="head,optimizer,loss,attention,layer,parts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from rollwise import models
    from rollwise.config import load_config
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model, _ = models.build(cfg.model)
    model.requires_grad_(True)
    levers = args.levers.split(",")
    known = ["head", "optimizer", "loss", "attention", "layer", "parts"]
    unknown = set(levers) - set(known)
    if unknown:
        ap.error(f"--levers: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    out = {"benchmark": "levers", "config": args.config, "dtype": str(model.dtype),
           "tokens": args.tokens, "threads": args.threads}
    if "head" in levers:
        out["head"] = alternate(head_arms(model, args.tokens), args.repeats)
    if "optimizer" in levers:
        out["optimizer"] = alternate(optimizer_arms(model), args.repeats)
    if "loss" in levers:
        arms, facts = loss_arms(args.tokens)
        out["loss"] = {**alternate(arms, args.repeats), **facts}
    batch = packed_batch(model.config.vocab_size, args.tokens, args.prompt_tokens,
                         cfg.generate.max_new_tokens)
    if "attention" in levers:
        arms, facts = attention_arms(model, batch)
        out["attention"] = {**alternate(arms, args.repeats), **facts,
                            "prompt_tokens": args.prompt_tokens}
    batches = [batch] + [packed_batch(model.config.vocab_size, args.tokens, args.prompt_tokens,
                                      cfg.generate.max_new_tokens, seed)
                         for seed in range(1, args.layer_batches)]
    for lever, part in (("layer", "block"), ("parts", "parts")):
        if lever in levers:
            arms, facts = layer_arms(model, batches, part)
            out[lever] = {**alternate(arms, args.repeats), **facts}
            out[lever]["compile_seconds"] = (  # the first round less a compiled one
                facts["first_round_seconds"] - out[lever]["seconds"]["torch.compile"])
    if args.json:
        print(json.dumps(out))
    else:
        for lever in levers:
            (a, ta), (b, tb) = out[lever]["seconds"].items()
            print(f"{lever}: {a} {ta:.4f} s, {b} {tb:.4f} s: {out[lever]['speedup']:.2f}x")
        for lever, gap in (("loss", "loss_gap"), ("layer", "logprob_gap"),
                           ("parts", "logprob_gap")):
            if lever in out:
                print(f"{lever}: compiled in {out[lever]['compile_seconds']:.1f} s, "
                      f"difference {out[lever][gap]:.1e}")
        for lever in ("layer", "parts"):
            if lever in out:
                a = out[lever]
                print(f"{lever}: {a['batches']} batches, {a['graphs_compiled']} graphs "
                      f"compiled; largest difference from float32: eager "
                      f"{a['eager_vs_fp32']:.2f}, compiled {a['compiled_vs_fp32']:.2f}")
        if "attention" in out:
            a = out["attention"]
            print(f"attention: {a['rows']} rows of {a['row_tokens']} tokens, scores "
                  f"{a['dense_scores']:,} dense, {a['segment_scores']:,} by segments, "
                  f"difference {a['logprob_gap']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
