"""The delta weight-sync formats the peers ship, coded on the same bf16 weights as rollwise's
own, for `rollwise bench sync` (bytes and time side by side; never used to sync an engine).

- verl (delta checkpoint engine, sharded over NCCL): per tensor, the flat int32 positions
  whose stored value changed and the new values there, uncompressed (6 bytes per change in
  bf16).
- slime (delta weight sync through disk): per tensor, the XOR of the new bytes with the
  engine's snapshot, zstd-compressed (level 3, zstd's default).
- SkyRL (DeltaPublisher): the same XOR-and-zstd idea at zstd level 1, its fast setting.

Each codec: encode(old, new) -> (payload, nbytes) and decode(old, payload) -> new, where old
and new map names to tensors of bf16 bits (int16 views). Decoding is bit-exact by
construction; the bench checks it on every step anyway.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

Bits = dict[str, torch.Tensor]


def bits(weights: dict[str, torch.Tensor]) -> Bits:
    """bf16 bits (int16, flat) of each tensor, as an engine in bf16 stores them."""
    return {k: v.detach().to(torch.bfloat16).reshape(-1).view(torch.int16).clone()
            for k, v in weights.items()}


def positions_encode(old: Bits, new: Bits):
    payload, nbytes = {}, 0
    for k, n in new.items():
        idx = (n != old[k]).nonzero().reshape(-1).to(torch.int32)
        vals = n[idx.long()]
        payload[k] = (idx, vals)
        nbytes += idx.numel() * 4 + vals.numel() * 2
    return payload, nbytes


def positions_decode(old: Bits, payload) -> Bits:
    out = {}
    for k, o in old.items():
        idx, vals = payload[k]
        t = o.clone()
        t[idx.long()] = vals
        out[k] = t
    return out


def xor_zstd(level: int) -> tuple[Callable, Callable]:
    # zstandard: optional, only to measure the peers' formats
    import zstandard

    def encode(old: Bits, new: Bits):
        cctx = zstandard.ZstdCompressor(level=level)
        payload = {k: cctx.compress((n ^ old[k]).numpy().tobytes()) for k, n in new.items()}
        return payload, sum(len(b) for b in payload.values())

    def decode(old: Bits, payload) -> Bits:
        dctx = zstandard.ZstdDecompressor()
        out = {}
        for k, o in old.items():
            x = np.frombuffer(dctx.decompress(payload[k], max_output_size=o.numel() * 2),
                              dtype=np.int16)
            out[k] = o ^ torch.from_numpy(x.copy())
        return out
    return encode, decode


def codecs() -> dict[str, tuple[Callable, Callable]]:
    """name -> (encode, decode). The XOR formats need the zstandard package."""
    return {"verl_positions": (positions_encode, positions_decode),
            "slime_xor_zstd3": xor_zstd(3), "skyrl_xor_zstd1": xor_zstd(1)}
