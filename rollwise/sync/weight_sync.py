"""Trainer -> engine weight sync, one `push()` after every trainer update.

    sync = build_sync(cfg.sync, trainer, engine)
    metrics = sync.push()    # sync/bytes, sync/density, sync/seconds, sync/sparse, ...

`sync.mode=sparse` ships SparseRL-Sync payloads (only the changed elements, exactly; with
the default `sync.coding=context`, index gaps and bit differences Rice-coded per exponent
group, ~0.5 bytes per change at a low lr) and
falls back to a full payload, as a whole, for a new engine or one that refuses the base version
or fails the checksum; `sync.check=true` also compares the engine's weights with the trainer's
bit for bit after every sync.
"""

from __future__ import annotations

import logging
import time

import torch

from rollwise.config import SyncConfig
from rollwise.sync.errors import SyncError, WeightMismatchError
from rollwise.sync.payload import PayloadMeta, bits, pack_meta, specs, to_dtype, unique_tensors
from rollwise.sync.receiver import Ack
from rollwise.sync.sender import Sender
from rollwise.sync.transport import WIRES, InProcessTransport, ProcessTransport, Transport

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, trainer, transport: Transport, *, mode: str = "full",
                 with_checksum: bool = True, check: bool = False, bucket_mb: float = 512,
                 coding: str = "context"):
        if mode not in ("full", "sparse"):
            raise ValueError(f"sync mode {mode!r}: use 'full' or 'sparse'")
        self.trainer, self.transport = trainer, transport
        self.mode, self.check = mode, check
        state = transport.state()
        check_same_tensors(specs(unique_tensors(trainer.weights())), state.spec)
        self.sender = Sender(state.spec, keep_mirror=mode == "sparse",
                             with_checksum=with_checksum, bucket_bytes=int(bucket_mb * 2**20),
                             coding=coding)
        self.totals = {"syncs": 0, "bytes": 0, "fallbacks": 0}

    def push(self, full: bool = False) -> dict[str, float]:
        """Bring the engine to the trainer's weights and version; returns the sync's metrics.
        `full=True` sends a full payload even in sparse mode."""
        t0 = time.perf_counter()
        weights, version = self.trainer.weights(), self.trainer.version
        fallback = 0.0
        full = full or self.mode == "full" or not self.sender.ready
        try:
            meta, ack = self._send(weights, version, full=full)
        except SyncError as e:
            if full:
                raise  # a full payload failed: nothing to fall back to
            log.warning("weight sync: %s -> sending a full payload", e)
            fallback = 1.0
            meta, ack = self._send(weights, version, full=True)
        seconds = time.perf_counter() - t0  # the check below is debugging, not the sync
        if self.check:
            self.compare(weights)
        nbytes = meta.nbytes + len(pack_meta(meta))
        self.totals["syncs"] += 1
        self.totals["bytes"] += nbytes
        self.totals["fallbacks"] += int(fallback)
        return {
            "sync/bytes": float(nbytes), "sync/full_bytes": float(self.sender.full_bytes),
            "sync/density": meta.changed / max(meta.total, 1),
            "sync/sparse": float(meta.kind == "sparse"), "sync/fallback_full": fallback,
            "sync/dense_tensors": float(meta.dense_tensors),
            "sync/seconds": seconds,
            "sync/encode_seconds": meta.seconds["encode"] + meta.seconds["checksum"],
            "sync/apply_seconds": ack.seconds.get("apply", 0.0),
            "sync/verify_seconds": ack.seconds.get("verify", 0.0),
        }

    def _send(self, weights, version: int, full: bool) -> tuple[PayloadMeta, Ack]:
        meta, arena = self.sender.encode(weights, version, self.transport.alloc, full=full)
        try:
            ack = self.transport.apply(meta, arena)
        except BaseException:
            self.sender.reset()  # the engine does not hold the mirror now
            raise
        return meta, ack

    def compare(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Check mode: the engine's weights equal the trainer's, cast to the engine's dtypes,
        bit for bit; raises WeightMismatchError naming the tensors that differ."""
        weights = self.trainer.weights() if weights is None else weights
        engine = self.transport.engine_weights()
        bad = []
        for name, theirs in engine.items():
            ours = weights[name].detach().to(theirs.dtype).reshape(theirs.shape)
            if not torch.equal(bits(ours.contiguous()), bits(theirs.contiguous())):
                bad.append(name)
        if bad:
            raise WeightMismatchError(f"after the sync to version {self.trainer.version}, "
                                      f"{len(bad)} engine tensor(s) differ from the trainer's: "
                                      f"{bad[:3]}")


def check_same_tensors(trainer_spec, engine_spec) -> None:
    if set(trainer_spec) != set(engine_spec):
        only_t = sorted(set(trainer_spec) - set(engine_spec))[:5]
        only_e = sorted(set(engine_spec) - set(trainer_spec))[:5]
        raise ValueError(f"the trainer's and the engine's models differ: only in the trainer "
                         f"{only_t}, only in the engine {only_e} (tied weights count once)")
    for name, s in engine_spec.items():
        if s.shape != trainer_spec[name].shape:
            raise ValueError(f"{name}: trainer shape {trainer_spec[name].shape}, engine shape "
                             f"{s.shape}")


def check_placement(cfg: SyncConfig, engine, transport) -> None:
    """The engine lives where sync.transport says, holding weights of sync.engine_dtype."""
    if engine.wire != WIRES.get(cfg.transport):
        where = f"a child process (wire {engine.wire})" if engine.wire else "this process"
        raise ValueError(f"sync.transport={cfg.transport} but the engine lives in {where}; "
                         f"build it with rollwise.engine.backends.build_engine(cfg, model)")
    if cfg.engine_dtype != "same":
        wrong = {n: s.dtype for n, s in transport.state().spec.items()
                 if s.dtype != cfg.engine_dtype and to_dtype(s.dtype).is_floating_point}
        if wrong:
            raise ValueError(f"sync.engine_dtype={cfg.engine_dtype} but the engine holds "
                             f"{sorted(set(wrong.values()))} weights (e.g. {next(iter(wrong))}); "
                             f"build it with rollwise.engine.backends.build_engine(cfg, model)")


def build_sync(cfg: SyncConfig, trainer, engine) -> WeightSync:
    """The weight sync `cfg` asks for between this trainer and this engine (an in-process
    engine, one in a child process, a Ray worker pool or vLLM;
    rollwise.engine.backends.build_engine). A LoRA trainer's engine, built on the base
    weights, is switched to adapters here: every payload then holds the adapters alone."""
    adapters = getattr(trainer, "adapters", None)
    if adapters is not None:  # LoRA: the engine keeps its weights as the base; only the
        engine.use_adapters(adapters)  # adapters travel from now on
    transport = engine.sync_transport()
    if isinstance(transport, (InProcessTransport, ProcessTransport)):  # not a Ray pool's
        check_placement(cfg, engine, transport)
    return WeightSync(trainer, transport, mode=cfg.mode, with_checksum=cfg.checksum,
                      check=cfg.check, bucket_mb=cfg.bucket_mb, coding=cfg.coding)
