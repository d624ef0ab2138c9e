"""Decode attention over the slot cache: the candidates the decode graph could use, timed at one
layer's shape (why it uses the one it does).

    rollwise bench attention [--batch 64] [--keys 128,256] [--threads 2] [--json]

Each decode row has one query per head and attends over keys 0..its position of its own slot:
the cache's first B rows as one slice (B, kv_heads, Lb, head_dim), masked per row. Candidates,
all on that slice in place (SmolLM2's heads by default, bf16, positions drawn between Lb/2
and Lb):
  sdpa_grouped  SDPA with a K/V head's query heads as its query block (B, kv_heads, group, d)
  sdpa_gqa      SDPA over (B, heads, 1, d) with enable_gqa
  bmm           batched products over the (B * kv_heads) flattened view, softmax in float32
  compiled      the same products and softmax under torch.compile
  flex          FlexAttention (compiled) with a per-row length score_mod
Median microseconds per call, and the largest difference from sdpa_gqa.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _time(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def candidates(q, k, v, positions, scale: float) -> dict:
    b, heads, _, d = q.shape
    kvh, lb = k.shape[1], k.shape[2]
    group = heads // kvh
    visible = torch.arange(lb)[None, :] <= positions[:, None]
    mask = visible[:, None, None, :]

    def sdpa_grouped():
        return F.scaled_dot_product_attention(q.reshape(b, kvh, group, d), k, v,
                                              attn_mask=mask, scale=scale).reshape(q.shape)

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=group > 1)

    def products(q, k, v, mask):
        s = torch.matmul(q.reshape(b, kvh, group, d), k.transpose(-1, -2)) * scale
        p = s.masked_fill(~mask, float("-inf")).float().softmax(-1).to(v.dtype)
        return torch.matmul(p, v).reshape(b, heads, 1, d)

    def bmm():
        s = torch.bmm(q.reshape(b * kvh, group, d), k.flatten(0, 1).transpose(1, 2)) * scale
        s = s.view(b, kvh, group, lb).masked_fill(~mask, float("-inf"))
        p = s.float().softmax(-1).to(v.dtype).view(b * kvh, group, lb)
        return torch.bmm(p, v.flatten(0, 1)).reshape(q.shape)

    compiled = torch.compile(products, dynamic=False)
    out = {"sdpa_grouped": sdpa_grouped, "sdpa_gqa": sdpa_gqa, "bmm": bmm,
           "compiled": lambda: compiled(q, k, v, mask)}
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)

        def score_mod(score, row, head, q_idx, kv_idx):
            return torch.where(kv_idx <= positions[row], score, -float("inf"))
        qg = q.reshape(b, kvh, group, d)
        out["flex"] = lambda: flex(qg, k, v, score_mod=score_mod, scale=scale).reshape(q.shape)
    except ImportError:
        pass
    return out


def run(batch: int, keys: int, heads: int, kv_heads: int, head_dim: int, length: int,
        dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(keys)
    cache_k = torch.randn(batch, kv_heads, length, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(batch, kv_heads, length, head_dim, generator=g).to(dtype)
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]  # the slice a decode pass reads
    q = torch.randn(batch, heads, 1, head_dim, generator=g).to(dtype)
    positions = torch.randint(keys // 2, keys, (batch,), generator=g)
    fns = candidates(q, k, v, positions, head_dim ** -0.5)
    with torch.inference_mode():
        ref = fns["sdpa_gqa"]().float()
        rows = []
        for name, fn in fns.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                rows.append({"keys": keys, "candidate": name, "us": round(_time(fn), 1),
                             "max_diff": err})
            except Exception as e:  # a candidate this torch cannot run here
                rows.append({"keys": keys, "candidate": name,
                             "failed": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--keys", default="128,256")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keys = [int(x) for x in args.keys.split(",")]
    rows = []
    for lb in keys:
        rows += run(args.batch, lb, args.heads, args.kv_heads, args.head_dim, max(keys) + 64,
                    getattr(torch, args.dtype))
    if args.json:
        print(json.dumps({"benchmark": "attention", "batch": args.batch,
                          "threads": torch.get_num_threads(), "rows": rows}))
    else:
        print("| keys | candidate | µs per layer | largest difference |\n|---|---|---|---|")
        for r in rows:
            cell = f"{r['us']:.0f} | {r['max_diff']:.2g}" if "us" in r else \
                f"failed | {r['failed']}"
            print(f"| {r['keys']} | {r['candidate']} | {cell} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
