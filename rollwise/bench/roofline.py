"""The machine's limits, measured with torch on the threads a run uses, and the bounds they set
on decoding and training (the CPU analogue of MFU and of decode bandwidth utilisation).

    rollwise bench roofline [--threads 2] [--device cpu] [--json]

Measured: the matrix-product rate in float32 and bfloat16 (square products, best of a few; on
a CPU the faster of torch's matmul and oneDNN's, both reported) and the memory bandwidth (a
large copy: bytes read + written per second, best of a few). Vendor peaks are used on
known GPUs (bench gpu); on a CPU the measured rates are the limit.

A decode step of B sequences multiplies each token through every Linear (2 FLOPs per weight)
and attends over its context (4 x layers x heads x head_dim FLOPs per key), and reads every
weight once and each sequence's K/V. So B sequences at mean context C decode at most

    B / max(B * flops_per_token(C) / peak_flops, (weight_bytes + B * kv_bytes(C)) / bandwidth)

tokens/s. A training token costs 6 x (Linear weights) + 12 x layers x hidden x keys / 2 FLOPs
(forward and backward, causal attention over half its context on average); a log-probability
pass, a third of that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rollwise.engine.graph_model import bf16_packing_works
from rollwise.engine.sizing import kv_bytes_per_token


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, device: str = "cpu", repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls after one warm-up (the least disturbed run)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_rate(dtype: torch.dtype, device: str = "cpu", n: int | None = None) -> float:
    """FLOP/s of an n x n by n x n product in `dtype`: the faster of torch's matmul and, on a
    CPU, oneDNN's (torch's float32 matmul goes to MKL, which on AMD CPUs runs at about half
    the rate oneDNN reaches: the machine's limit is the faster one)."""
    return max(_rates(dtype, device, n).values())


def _rates(dtype: torch.dtype, device: str, n: int | None) -> dict[str, float]:
    n = n or (8192 if device.startswith("cuda") else 2048)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    rates = {"torch": 2 * n ** 3 / best_time(lambda: a @ b, device)}
    if device == "cpu" and torch.backends.mkldnn.is_available() and (
            dtype != torch.bfloat16 or bf16_packing_works()):  # oneDNN's bf16 needs AVX512
        am, bm = a.to_mkldnn(), b.t().contiguous().to_mkldnn()  # linear: x @ w.T
        rates["onednn"] = 2 * n ** 3 / best_time(
            lambda: torch._C._nn.mkldnn_linear(am, bm, None), device)
    return rates


def matmul_kernels(device: str = "cpu") -> dict[str, dict[str, float]]:
    """Each dtype's rate by kernel (torch's matmul, oneDNN's), for the record."""
    return {name: _rates(getattr(torch, name), device, None) for name in ("float32", "bfloat16")}


def bandwidth(device: str = "cpu", n_bytes: int | None = None) -> float:
    """Bytes/s of a large copy, counting the bytes read and the bytes written."""
    n_bytes = n_bytes or (2 ** 30 if device.startswith("cuda") else 2 ** 28)
    x = torch.ones(n_bytes // 4, device=device)
    y = torch.empty_like(x)
    return 2 * n_bytes / best_time(lambda: y.copy_(x), device)


def measure(device: str = "cpu") -> dict:
    """{'flops': {'float32': .., 'bfloat16': ..}, 'bandwidth': bytes/s, 'threads': n}."""
    kernels = matmul_kernels(device)
    return {"device": device, "threads": torch.get_num_threads(),
            "flops": {name: max(rates.values()) for name, rates in kernels.items()},
            "flops_by_kernel": kernels, "bandwidth": bandwidth(device)}


def peak_flops(peaks: dict, dtype: torch.dtype) -> float:
    """The matrix rate for a model in `dtype` (fp16 counts as bf16: same width)."""
    return peaks["flops"]["float32" if dtype == torch.float32 else "bfloat16"]


# ---------------------------------------------------------------------------- model bounds

def linear_weights(model) -> int:
    """Weights that take part in a matmul per token: every Linear, the LM head included."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _query_width(config) -> int:
    """Query heads x head dim: the width attention's products run over."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def decode_flops_per_token(model, context: float) -> float:
    """Forward FLOPs of one decoded token at `context` keys (scores and weighted sum)."""
    return 2 * linear_weights(model) + 4 * model.config.num_hidden_layers * \
        _query_width(model.config) * context


def decode_bytes_per_step(model, batch: int, context: float, kv_dtype: torch.dtype) -> float:
    """Bytes one decode step must read: every weight once, each sequence's K/V."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + batch * kv_bytes_per_token(model.config, kv_dtype) * context


def decode_bound(model, peaks: dict, batch: int, context: float) -> float:
    """The most tokens/s `batch` sequences at mean `context` can decode on this machine."""
    dtype = next(model.parameters()).dtype
    compute = batch * decode_flops_per_token(model, context) / peak_flops(peaks, dtype)
    memory = decode_bytes_per_step(model, batch, context, dtype) / peaks["bandwidth"]
    return batch / max(compute, memory)


def train_flops_per_token(model, context: float) -> float:
    """Forward + backward FLOPs of one trained token in a sequence of `context` tokens."""
    return 6 * linear_weights(model) + 6 * model.config.num_hidden_layers * \
        _query_width(model.config) * context


def table(result: dict) -> str:
    f, k = result["flops"], result["flops_by_kernel"]

    def kernels(name):
        return ", ".join(f"{kernel} {rate / 1e9:.0f}" for kernel, rate in k[name].items())
    return "\n".join([
        "| threads | fp32 matmul GFLOP/s | bf16 matmul GFLOP/s | bf16 / fp32 | memory bandwidth |",
        "|---|---|---|---|---|",
        f"| {result['threads']} | {f['float32'] / 1e9:.0f} ({kernels('float32')}) | "
        f"{f['bfloat16'] / 1e9:.0f} ({kernels('bfloat16')}) | "
        f"{f['bfloat16'] / f['float32']:.2f}x | {result['bandwidth'] / 1e9:.1f} GB/s |"])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"benchmark": "roofline", **measure(args.device)}
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
