"""train.world_size > 1: the trainer as N ranks, each holding a shard of the model (FSDP2,
`torch.distributed.fsdp.fully_shard`; gloo on CPU, NCCL on GPU): spawned processes on this
machine (ProcessRanks), or Ray actors with loop.backend=ray (rollwise.training.ray_ranks.RayRanks).

    trainer = ShardedTrainer(model, cfg.train, pad_id=tok.pad_token_id, world_size=2)
    metrics = trainer.update(groups)     # every rank updates; the full weights come back
    trainer.close()

Every rank gets the whole step's groups and computes the same advantages, masks and old
log-probabilities; the optimizer step's micro-batches are dealt out over the ranks, each loss
normalized by the whole minibatch's counts and the gradients summed, so the update is the one
rank's within float tolerance. Rank 0 gathers the full weights after each update into this
process's model, from which the weight sync reads. A rank that dies stops the run with an error
naming it; the run's last checkpoint is where `--resume` continues.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rollwise.sync.payload import from_wire, to_wire
from rollwise.training import packed_attention
from rollwise.training.compiled import blocks
from rollwise.training.trainer import Trainer
from rollwise.waits import STARTUP_S, NoAnswer, Peer, PeerDied, answers, deliver


class TrainerRankError(RuntimeError):
    """A trainer rank died or failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardedTrainer:
    """The Trainer's interface (update, weights, version, state_dict) over FSDP2 ranks.
    `ranks(init, world, timeout)` starts them: ProcessRanks here (spawned processes), or
    rollwise.training.ray_ranks.RayRanks (Ray actors, loop.backend=ray)."""

    adapters = None  # full weights only: train.lora is refused with world_size > 1

    def __init__(self, model, cfg, *, pad_id: int, seed: int = 0, world_size: int = 2,
                 timeout_s: float = 1800.0, ranks=None):
        if cfg.kl_coef > 0 or cfg.correction.snapshots > 0:
            raise ValueError("train.world_size > 1 does not keep a reference model or "
                             "snapshots yet: set train.kl_coef=0 and "
                             "train.correction.snapshots=0, or train.world_size=1")
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("train.world_size > 1 trains float32 parameters: set "
                             "model.dtype=float32 (the engine may still run sync.engine_dtype)")
        self.model, self.cfg, self.version = model, cfg, 0
        self.world = world_size
        init = {"cls": type(model), "config": packed_attention.portable(model.config), "cfg": cfg,
                "pad_id": pad_id, "seed": seed, "world": world_size,
                "state": {k: to_wire(v) for k, v in model.state_dict().items()}}
        self.ranks = (ranks or ProcessRanks)(init, world_size, timeout_s)

    def update(self, groups, dropped=()) -> dict[str, float]:
        replies = self._all("update", groups, list(dropped))
        metrics, weights = replies[0]
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                t.copy_(from_wire(weights[name]))
        self.version += 1
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """Each rank's shards of the model and optimizer state, the scheduler, the version
        and the full weights (a resume needs the same train.world_size)."""
        return {"ranks": self._all("state"), "version": self.version,
                "model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["ranks"]) != self.world:
            raise ValueError(f"this checkpoint was written by {len(state['ranks'])} trainer "
                             f"ranks; resume it with train.world_size={len(state['ranks'])}")
        self.ranks.call([("load", rank_state) for rank_state in state["ranks"]])
        self.model.load_state_dict(state["model"])
        self.version = state["version"]

    def _all(self, cmd: str, *args) -> list:
        return self.ranks.call([(cmd, *args)] * self.world)

    def close(self) -> None:
        self.ranks.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass




class ProcessRanks:
    """Trainer ranks as spawned processes on this machine, one pipe each; every wait on them
    is bounded by rollwise.waits."""

    def __init__(self, init: dict, world: int, timeout_s: float):
        init = {**init, "addr": "127.0.0.1", "port": _free_port()}
        self.timeout = timeout_s
        ctx = mp.get_context("spawn")
        self.peers: list[Peer] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, child, init), daemon=True,
                               name=f"rollwise-trainer-{rank}")
            proc.start()
            child.close()
            self.peers.append(Peer(f"trainer rank {rank}", proc, parent))
        self._gather("start", max(self.timeout, STARTUP_S))

    @property
    def procs(self) -> list:
        return [p.proc for p in self.peers]

    def call(self, messages: list[tuple]) -> list:
        """Each rank its message; their replies in rank order, within the timeout."""
        cmd = messages[0][0]
        try:
            deliver(self.peers, messages, f"take its '{cmd}' message", self.timeout)
        except (NoAnswer, PeerDied) as e:
            raise rank_failed(e, cmd) from None
        return self._gather(cmd)

    def _gather(self, cmd: str, timeout_s: float | None = None) -> list:
        """Every rank's reply to `cmd`; a rank that dies meanwhile (the others then wait in a
        collective for it) or stays silent past the timeout stops the run, named."""
        try:
            replies = answers(self.peers, f"finish '{cmd}'", timeout_s or self.timeout)
        except (NoAnswer, PeerDied) as e:
            raise rank_failed(e, cmd) from None
        for rank, reply in enumerate(replies):
            if reply[0] == "error":
                raise TrainerRankError(f"trainer rank {rank} failed in '{cmd}': {reply[1]}")
        return [reply[1] for reply in replies]

    def close(self) -> None:
        """Ask every rank to end, give them 10 s together, then kill what is left (a stopped
        rank, or one waiting in a collective for it)."""
        for peer in self.peers:
            if peer.proc.is_alive():  # a send to a stopped rank blocks only its thread
                threading.Thread(target=_send_quietly, args=(peer.conn, ("close",)),
                                 daemon=True).start()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.peers = []


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the rank is gone already
        pass


def rank_failed(e: NoAnswer | PeerDied, cmd: str) -> TrainerRankError:
    """The run's error for a rank that died or did not answer `cmd` (rollwise.waits)."""
    what = f"{e.peer} died during '{cmd}' ({e.how})" if isinstance(e, PeerDied) else str(e)
    return TrainerRankError(f"{what}; the run stops here, resume from its last checkpoint "
                            f"with 'rollwise train --resume RUN'")


def build_rank(rank: int, init: dict):
    """This rank's Trainer over its shard of the model."""

    os.environ.update(MASTER_ADDR=init["addr"], MASTER_PORT=str(init["port"]))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=init["world"])
    torch.set_num_threads(1)
    model = init["cls"](init["config"])
    model.load_state_dict({k: from_wire(v) for k, v in init["state"].items()})
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        model.cuda()
    for layer in blocks(model):
        fully_shard(layer)
    fully_shard(model)
    trainer = Trainer(model, init["cfg"], pad_id=init["pad_id"], seed=init["seed"])
    trainer.shard = (rank, init["world"])
    return trainer


def _full_weights(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v  # a collective: every rank
        out[k] = to_wire(full.detach().cpu())
    return out


def handle(trainer, rank: int, cmd: str, *args):
    """One command on one rank (the process and the Ray ranks share it)."""
    if cmd == "update":
        metrics = trainer.update(*args)
        weights = _full_weights(trainer.model)  # a collective: every rank takes part
        return (metrics, weights) if rank == 0 else None
    if cmd == "state":
        return _rank_state(trainer)
    if cmd == "load":
        _load_rank_state(trainer, args[0])
        return None
    raise ValueError(f"unknown trainer-rank command {cmd!r}")


def _rank_main(rank: int, conn, init: dict) -> None:
    try:
        trainer = build_rank(rank, init)
        conn.send(("ok", None))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            cmd, *args = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "close":
            break
        try:
            conn.send(("ok", handle(trainer, rank, cmd, *args)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _rank_state(trainer) -> dict:
    """This rank's shards of the model and the optimizer state, as plain tensors, and the
    scheduler and version."""
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"model": {k: local(v) for k, v in trainer.model.state_dict().items()},
            "optimizer": [{k: local(v) for k, v in opt.state.get(p, {}).items()}
                          for p in params],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "scheduler": trainer.scheduler.state_dict(), "version": trainer.version}


def _load_rank_state(trainer, state: dict) -> None:
    """_rank_state's result written back in place (a fresh rank gets its optimizer state)."""
    with torch.no_grad():
        for k, v in trainer.model.state_dict().items():
            (v.to_local() if hasattr(v, "to_local") else v).copy_(state["model"][k])
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, saved in zip(params, state["optimizer"]):
        opt.state[p] = {k: DTensor.from_local(v.clone(), p.device_mesh, p.placements)
                        if isinstance(p, DTensor) and v.dim() > 0 else v.clone()
                        for k, v in saved.items()}
    for g, saved in zip(opt.param_groups, state["groups"]):
        g.update(saved)
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.version = state["version"]
