"""loop.backend=ray: rollout workers as Ray actors, each with an engine (the built-in one, or
vLLM with engine.backend=vllm), behind the one engine interface the stages already drive
(rollwise/engine/base.py). Ray is imported here, in rollwise.training.ray_ranks (the trainer's
ranks) and in rollwise.ray_cluster (starting it), nowhere else.

    rollwise train loop.backend=ray loop.rollout_workers=2              # Ray on this machine
    rollwise train loop.backend=ray loop.ray_address=ray://head:10001    # a running cluster
    rollwise train loop.backend=ray engine.backend=vllm                 # vLLM in each worker

- Requests are spread over the workers by load; a tree's children stay on their parent's
  worker (they share its K/V).
- Seeds: a request without a seed gets one from the pool's own seeded stream, drawn in the
  order the in-process engine draws (one per request, one per forked child). So a request's
  uniforms do not depend on the worker it lands on, one worker at seed s samples what the
  in-process engine does, and the stream's state goes into checkpoints (a resumed run samples
  what an uninterrupted one would). A re-queued sequence continues on a stream derived from
  its seed and length.
- A vLLM worker builds the model from its config, saves it in its own temporary folder and
  starts vLLM on it; the weights come with the first payload, as a built-in worker's do, so
  no node needs the trainer's files. It takes a GPU where the cluster has one per worker
  (VLLM_* environment variables of the driver are passed on).
- Weights: each payload of the weight sync (full or sparse, rollwise/sync/) is put into the
  object store once and applied by every worker, bit-exactly verified there. The payloads since
  the last full one are kept, so a worker that joins later replays them to the current version.
- Faults: a worker that dies (or does not answer within loop.wait_timeout_s) is replaced; its
  requests go on elsewhere as continuations, prompt plus every token already delivered, with
  the rest of the token budget: no rollout is lost and no token is produced twice (their later
  draws differ from an uninterrupted run's: see Seeds above). `join()` and
  `leave()` change the pool during a run. Metrics count the deaths and re-queued requests.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
from dataclasses import dataclass, field

import ray
import torch

from rollwise import ray_cluster
from rollwise.engine.base import Completion, Engine, Request
from rollwise.engine.process import build_engine_in_child
from rollwise.engine.sampling import derived_seed
from rollwise.engine.scheduler import Event
from rollwise.engine.sizing import engine_dtype, kv_budget_tokens, prefix_cache_tokens, vllm_kwargs
from rollwise.sync.payload import dtype_name, from_wire, pack_meta, to_dtype, to_wire, unpack_meta
from rollwise.sync.receiver import Receiver
from rollwise.sync.sender import Sender
from rollwise.sync.transport import GrowingBuffer
from rollwise.training import packed_attention
from rollwise.waits import STARTUP_S, PeerDied

COLUMNS = ("token_ids", "logprobs", "entropies", "versions")
MAX_TRIES = 8  # workers lost in a row before a call gives up
MAX_CHAIN = 8  # sparse payloads kept for joining workers before they are folded into a full one


class RolloutWorker:
    """One engine in a Ray actor: a built-in one (built as an engine process's child builds
    its own) or vLLM."""

    def __init__(self, init: dict):
        if init.get("backend") == "vllm":
            self.engine = self._build_vllm(init)
        else:
            self.engine = build_engine_in_child(init)
        self.receiver = Receiver(self.engine)

    def _build_vllm(self, init: dict):
        """vLLM on the model saved from its config with zero weights (the first full payload
        writes them): its folder is this worker's own, removed with it."""

        # vLLM: only in a vLLM worker
        from rollwise.engine.vllm import VLLMEngine
        torch.set_num_threads(init["threads"])
        with torch.device("meta"):
            model = init["cls"](init["config"])
        model.to_empty(device="cpu")
        model.tie_weights()
        with torch.no_grad():
            for t in model.state_dict().values():
                t.zero_()
        dtype = init["dtype"] or dtype_name(model.dtype)
        self._folder = tempfile.TemporaryDirectory(prefix="rollwise-vllm-")
        model.to(to_dtype(dtype)).save_pretrained(self._folder.name)
        return VLLMEngine(self._folder.name, version=-1, dtype=dtype, **init["engine_kwargs"])

    def pid(self) -> int:
        return os.getpid()

    def counts(self) -> tuple[int, int | None]:
        """Tokens this worker's engine decoded and prefilled (None: it does not count)."""
        return self.engine.tokens_generated, getattr(self.engine, "prefill_tokens", None)

    def call(self, method: str, *args, **kwargs):
        out = getattr(self.engine, method)(*args, **kwargs)
        return out, self.counts(), self.engine.version

    def sync_state(self):
        return self.receiver.state()

    def apply(self, packed_meta: bytes, data):
        ack = self.receiver.apply(unpack_meta(packed_meta), torch.from_numpy(data))
        return ack, self.counts(), self.engine.version

    def weights(self) -> dict:
        return {k: to_wire(v) for k, v in self.receiver.tensors().items()}


def _added(a: tuple[int, int | None], b: tuple[int, int | None]) -> tuple[int, int | None]:
    """Two workers' (decoded, prefilled) counts summed; prefilled is None if either's is."""
    return a[0] + b[0], None if a[1] is None or b[1] is None else a[1] + b[1]


@dataclass
class _Seq:
    """A request as the caller sees it, wherever it runs now."""
    worker: int  # the worker's key in WorkerPool.workers
    local: int  # its seq_id on that worker
    request: Request  # as first submitted
    delivered: dict[str, list] = field(default_factory=lambda: {c: [] for c in COLUMNS})
    offset: int = 0  # delivered tokens from before this worker's copy (a re-queue)
    paused: Completion | None = None


class WorkerPool(Engine):
    """The engine protocol (add, step, fork, pause, resume, abort, generate, version) over
    Ray rollout workers; see the module docstring."""

    def __init__(self, model, n_workers: int, *, timeout_s: float = 600.0, dtype=None,
                 threads: int = 1, backend: str = "builtin", **engine_kwargs):
        if n_workers < 1:
            raise ValueError(f"loop.rollout_workers = {n_workers}: need at least 1")
        self.timeout = timeout_s
        self.init = {"cls": type(model), "config": packed_attention.portable(model.config),
                     "backend": backend,
                     "buffers": {n: to_wire(b) for n, b in model.named_buffers()},
                     "dtype": None if dtype is None else dtype_name(dtype),
                     "threads": threads, "engine_kwargs": engine_kwargs}
        options: dict = {"num_cpus": 1}
        if backend == "vllm":
            env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
            options["runtime_env"] = {"env_vars": env}
            if ray.cluster_resources().get("GPU", 0) >= n_workers:
                options["num_gpus"] = 1
        self.actor_cls = ray.remote(**options)(RolloutWorker)
        self.workers: dict[int, object] = {}
        self.next_key = 0
        self.seqs: dict[int, _Seq] = {}
        self.local_to_global: dict[tuple[int, int], int] = {}
        self.next_id = 0
        self._seeds = random.Random(engine_kwargs.get("seed", 0))
        self.version = -1
        self.tokens_generated = 0
        self.prefill_tokens: int | None = None  # summed as tokens_generated, once counted
        self._counts: dict[int, tuple[int, int | None]] = {}  # per live worker: its counts
        self._dead_counts = (0, 0)
        self.chain: list = []  # object refs of the payloads since the last full one
        self.base_chain: list = []  # LoRA: the base weights' payloads, under every adapter one
        self.adapters = None  # LoRA: the AdapterSpec the workers apply
        self.max_chain = MAX_CHAIN
        self.counts = {"worker_deaths": 0, "requeued": 0, "joined": 0, "left": 0}
        self.buffer = GrowingBuffer()
        for key, actor in [self._spawn() for _ in range(n_workers)]:  # they start together
            self._admit(key, actor)
        self._broadcast_full({k: v.detach() for k, v in model.state_dict().items()}, 0)

    # ---- membership ------------------------------------------------------------------------
    def join(self) -> int:
        """Start one more worker, brought to the current weights; returns its key. One that
        dies while it starts is replaced in turn (MAX_TRIES in a row, then the run stops)."""
        for _ in range(MAX_TRIES):
            key, actor = self._spawn()
            try:
                return self._admit(key, actor)
            except _WorkerLost:
                self.counts["worker_deaths"] += 1
                self._counts.pop(key, None)
                _kill(actor)
        raise RuntimeError(f"{MAX_TRIES} rollout workers in a row died while starting; see the "
                           f"Ray logs (/tmp/ray/session_latest/logs) for why")

    def _spawn(self) -> tuple[int, object]:
        key, self.next_key = self.next_key, self.next_key + 1
        return key, self.actor_cls.remote(self.init)

    def _admit(self, key: int, actor) -> int:
        self._counts[key] = (0, 0)
        # starting a process that imports torch takes longer than a call: its own allowance
        self._get(actor.pid.remote(), key, "start", max(self.timeout, STARTUP_S))
        for ref in self.base_chain:  # LoRA: the base weights, then the adapters on them
            self._get(actor.apply.remote(*ref), key, "apply the base weights")
        if self.adapters is not None:
            self._get(actor.call.remote("use_adapters", self.adapters), key, "take adapters")
        for ref in self.chain:  # replay: full payload, then each sparse one
            self._get(actor.apply.remote(*ref), key, "apply the weights")
        self.workers[key] = actor  # only now: a replay never meets a half-joined worker
        self.counts["joined"] += 1
        return key

    def leave(self, key: int) -> None:
        """Take a worker out; its requests go on elsewhere."""
        actor = self.workers.pop(key)
        self.counts["left"] += 1
        self._requeue(key)
        ray.kill(actor)

    def pids(self) -> dict[int, int]:
        return {k: self._get(a.pid.remote(), k, "report its pid") for k, a in self.workers.items()}

    def metrics(self) -> dict[str, float]:
        return {f"workers/{k}": float(v) for k, v in self.counts.items()} | {
            "workers/live": float(len(self.workers))}

    # ---- the engine protocol ---------------------------------------------------------------
    def add(self, request: Request) -> int:
        if request.params.seed is None:
            request = dataclasses.replace(request, params=dataclasses.replace(
                request.params, seed=self._seeds.getrandbits(63)))
        for _ in range(MAX_TRIES):
            key = self._least_loaded()
            try:
                return self._register(key, self._call(key, "add", request), request)
            except _WorkerLost:
                continue
        raise RuntimeError(f"adding request {request.id!r}: {MAX_TRIES} rollout workers were "
                           f"lost in a row")

    def has_unfinished(self) -> bool:
        return any(s.paused is None for s in self.seqs.values())

    def step(self) -> list[Event]:
        busy = sorted({s.worker for s in self.seqs.values() if s.paused is None})
        refs = {k: self.workers[k].call.remote("step") for k in busy}
        events = []
        for key, ref in refs.items():
            try:
                out = self._result(key, ref)
            except _WorkerLost:
                continue  # its sequences were re-queued
            for ev in out:
                gid = self.local_to_global.get((key, ev.seq_id))
                if gid is None:
                    continue
                s = self.seqs[gid]
                for c in COLUMNS:
                    s.delivered[c] += getattr(ev, c)
                events.append(dataclasses.replace(ev, seq_id=gid))
                if ev.finished:
                    self._forget(gid)
        return events

    def fork(self, seq_id: int, n: int, *, seeds=None, params=None,
             last_tokens=None) -> list[int]:
        if seeds is None:
            seeds = [self._seeds.getrandbits(63) for _ in range(n)]
        locals_ = self._on_seq(seq_id, "fork", n, seeds=seeds, params=params,
                               last_tokens=last_tokens)
        s, out = self.seqs[seq_id], []
        for local, seed in zip(locals_, seeds):
            own = dataclasses.replace(params or s.request.params, seed=seed)
            gid = self._register(s.worker, local, dataclasses.replace(s.request, params=own))
            child = self.seqs[gid]
            child.offset = s.offset
            child.delivered = {c: list(v) for c, v in s.delivered.items()}
            if last_tokens is not None:  # the replacement comes in the child's next event
                for v in child.delivered.values():
                    del v[-1:]
            out.append(gid)
        return out

    def pause(self, seq_id: int) -> Completion:
        c = self._on_seq(seq_id, "pause")
        s = self.seqs[seq_id]
        c = self._whole(s, c)
        s.paused = c
        return c

    def resume(self, seq_id: int) -> None:
        s = self.seqs[seq_id]
        if s.paused is None:
            raise ValueError(f"sequence {seq_id} is not paused")
        s.delivered = {c: list(getattr(s.paused, c)) for c in COLUMNS}
        s.paused = None
        self._continue_elsewhere(seq_id, s, self._least_loaded())

    def abort(self, seq_id: int) -> Completion:
        s = self.seqs[seq_id]
        c = s.paused if s.paused is not None else self._on_seq(seq_id, "abort")
        if s.paused is None:
            c = self._whole(self.seqs[seq_id], c)
        self._forget(seq_id)
        return dataclasses.replace(c, finish_reason="abort")

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to the end, spread over the workers; completions in request order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle pool, but requests added with add() "
                               "are still running")
        ids = [self.add(r) for r in requests]
        got: dict[int, dict[str, list]] = {gid: {c: [] for c in COLUMNS} for gid in ids}
        reasons: dict[int, str] = {}
        while self.has_unfinished():
            for ev in self.step():
                for c in COLUMNS:
                    got[ev.seq_id][c] += getattr(ev, c)
                if ev.finished:
                    reasons[ev.seq_id] = ev.finish_reason
        return [Completion(r.id, **got[gid], finish_reason=reasons[gid], seq_id=gid)
                for gid, r in zip(ids, requests)]

    def state_dict(self) -> dict:
        """The request-seed stream and id counter, as the in-process engine's."""
        return {"seeds": self._seeds.getstate(), "next_id": self.next_id}

    def load_state_dict(self, state: dict) -> None:
        self._seeds.setstate(state["seeds"])
        self.next_id = state["next_id"]

    # ---- weight sync (rollwise.sync.weight_sync uses this transport) -----------------------
    def sync_transport(self) -> "PoolTransport":
        return PoolTransport(self)

    def use_adapters(self, spec) -> None:
        """LoRA: every worker applies adapters from now on (rollwise/engine/adapters.py); the
        weights sent so far are their base, replayed first to a worker that joins later."""
        self.base_chain, self.chain, self.adapters = self.chain, [], spec
        for key in list(self.workers):  # one that replaces a lost worker joins with them
            if key not in self.workers:
                continue
            try:
                self._call(key, "use_adapters", spec)
            except _WorkerLost:
                continue

    def sync_state(self):
        state = self.ask_any(lambda actor: actor.sync_state.remote(), "report its weights")
        return dataclasses.replace(state, version=self.version)

    def ask_any(self, call, what: str):
        """call(actor) on a live worker; one lost meanwhile is replaced and another asked."""
        for _ in range(MAX_TRIES):
            key = next(iter(self.workers))
            try:
                return self._get(call(self.workers[key]), key, what)
            except _WorkerLost:
                self._lost(key)
        raise RuntimeError(f"{MAX_TRIES} rollout workers in a row were lost asked to {what}")

    def _broadcast_full(self, state: dict, version: int) -> None:
        sender = Sender(self.sync_state().spec, keep_mirror=False, with_checksum=True,
                        bucket_bytes=2**62)
        meta, arena = sender.encode(state, version, self.buffer.take, full=True)
        self.apply(meta, arena)

    def apply(self, meta, arena: torch.Tensor):
        """Put one payload into the object store; every worker applies it."""
        ref = (pack_meta(meta), ray.put(arena[:meta.nbytes].numpy()))
        self.chain = [ref] if meta.kind == "full" else self.chain + [ref]
        acks = {k: a.apply.remote(*ref) for k, a in self.workers.items()}
        ack = None
        for key, r in acks.items():
            try:
                ack = self._result(key, r)
            except _WorkerLost:
                continue
        self.version = meta.version
        if len(self.chain) > self.max_chain:
            self._fold_chain()
        return ack

    def _fold_chain(self) -> None:
        """Replace the kept payloads by one full payload of a live worker's weights (the same
        bits, so the same checksums: later sparse payloads apply to a worker that joins)."""
        wired = self.ask_any(lambda actor: actor.weights.remote(), "send its weights")
        sender = Sender(self.sync_state().spec, keep_mirror=False, with_checksum=True,
                        bucket_bytes=2**62)
        meta, arena = sender.encode({k: from_wire(v) for k, v in wired.items()}, self.version,
                                    self.buffer.take, full=True)
        self.chain = [(pack_meta(meta), ray.put(arena[:meta.nbytes].numpy()))]

    # ---- bookkeeping -----------------------------------------------------------------------
    def _register(self, key: int, local: int, request: Request) -> int:
        gid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[gid] = _Seq(key, local, request)
        self.local_to_global[(key, local)] = gid
        return gid

    def _forget(self, gid: int) -> None:
        s = self.seqs.pop(gid)
        self.local_to_global.pop((s.worker, s.local), None)

    def _whole(self, s: _Seq, c: Completion) -> Completion:
        """A worker's completion with the tokens delivered before it took the request."""
        before = {col: s.delivered[col][:s.offset] for col in COLUMNS}
        return dataclasses.replace(c, **{col: before[col] + list(getattr(c, col))
                                         for col in COLUMNS},
                                   branch_point=c.branch_point + s.offset)

    def _least_loaded(self) -> int:
        if not self.workers:
            raise RuntimeError("no rollout worker is left: every worker died or left; "
                               "join() one or raise loop.rollout_workers")
        load = {k: 0 for k in self.workers}
        for s in self.seqs.values():
            if s.paused is None and s.worker in load:
                load[s.worker] += 1
        return min(load, key=lambda k: (load[k], k))

    def _continue_elsewhere(self, gid: int, s: _Seq, key: int) -> None:
        """Submit what is left of a sequence to worker `key`: prompt + delivered tokens."""
        done = len(s.delivered["token_ids"])
        params = dataclasses.replace(s.request.params,
                                     max_new_tokens=s.request.params.max_new_tokens - done,
                                     seed=derived_seed(s.request.params.seed, done))
        req = Request(s.request.prompt_ids + s.delivered["token_ids"], params, s.request.id)
        self.local_to_global.pop((s.worker, s.local), None)
        for _ in range(MAX_TRIES):
            try:
                s.local = self._call(key, "add", req)
                break
            except _WorkerLost:
                key = self._least_loaded()
        else:
            raise RuntimeError(f"re-queueing sequence {gid}: {MAX_TRIES} rollout workers were "
                               f"lost in a row")
        s.worker, s.offset = key, done
        self.local_to_global[(key, s.local)] = gid

    def _requeue(self, dead: int) -> None:
        self._dead_counts = _added(self._dead_counts, self._counts.pop(dead, (0, 0)))
        for gid, s in list(self.seqs.items()):
            if s.worker == dead and s.paused is None:
                self.counts["requeued"] += 1
                self._continue_elsewhere(gid, s, self._least_loaded())
            elif s.worker == dead:
                s.worker = -1  # paused: resume() places it

    def _lost(self, key: int) -> None:
        actor = self.workers.pop(key, None)
        if actor is None:
            return
        self.counts["worker_deaths"] += 1
        _kill(actor)
        self.join()  # a replacement at the current weights
        self._requeue(key)

    def _call(self, key: int, method: str, *args, **kwargs):
        return self._result(key, self.workers[key].call.remote(method, *args, **kwargs))

    def _on_seq(self, gid: int, method: str, *args, **kwargs):
        """`method` on the worker that runs sequence gid now: a lost worker's sequences were
        re-queued elsewhere, so the call goes again to their new place."""
        for _ in range(MAX_TRIES):
            s = self.seqs[gid]
            try:
                return self._call(s.worker, method, s.local, *args, **kwargs)
            except _WorkerLost:
                continue
        raise RuntimeError(f"{method} of sequence {gid}: {MAX_TRIES} rollout workers were lost "
                           f"in a row")

    def _result(self, key: int, ref):
        """A generation call's result; a worker that died or did not answer is replaced."""
        try:
            out, counts, version = self._get(ref, key, "answer a call")
        except (TimeoutError, _WorkerLost):
            self._lost(key)
            raise _WorkerLost(key) from None
        self._counts[key] = counts
        total = self._dead_counts
        for c in self._counts.values():
            total = _added(total, c)
        self.tokens_generated, self.prefill_tokens = total
        return out

    def _get(self, ref, key, what: str, timeout: float | None = None):
        """ray.get within the timeout (rollwise.waits's rule); a worker that died meanwhile is
        _WorkerLost (its caller replaces it), one that does not answer NoAnswer naming it."""
        try:
            return ray_cluster.answers([ref], [f"rollout worker {key}"], what,
                                       timeout or self.timeout)[0]
        except PeerDied:
            raise _WorkerLost(key) from None


class _WorkerLost(Exception):
    pass


def _kill(actor) -> None:
    try:
        ray.kill(actor)
    except Exception:  # already gone
        pass


class PoolTransport:
    """rollwise.sync's Transport over a WorkerPool: one object-store put per payload."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def state(self):
        return self.pool.sync_state()

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self.pool.buffer.take(nbytes)

    def apply(self, meta, arena: torch.Tensor):
        return self.pool.apply(meta, arena)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        wired = self.pool.ask_any(lambda actor: actor.weights.remote(), "send its weights")
        return {k: from_wire(v) for k, v in wired.items()}


def worker_pool(cfg, model) -> WorkerPool:
    """The pool loop.backend=ray asks for: Ray started here (or joined at loop.ray_address)."""
    ray_cluster.start(cfg)
    dtype = None if cfg.sync.engine_dtype == "same" else engine_dtype(cfg, model)
    common = dict(timeout_s=cfg.loop.wait_timeout_s, dtype=dtype,
                  threads=max(1, cfg.run.threads))
    if cfg.engine.backend == "vllm":
        kwargs = vllm_kwargs(cfg, model, colocated=False)
        common["dtype"] = to_dtype(kwargs.pop("dtype"))
        return WorkerPool(model, cfg.loop.rollout_workers, backend="vllm", **common, **kwargs)
    return WorkerPool(model, cfg.loop.rollout_workers, **common,
                      max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                      segment=cfg.engine.segment, kv_budget_tokens=kv_budget_tokens(cfg, model),
                      prefix_cache_tokens=prefix_cache_tokens(cfg), graph=cfg.engine.graph,
                  share_prefix=cfg.engine.share_prefix)
