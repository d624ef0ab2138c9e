"""An engine in a child process on this machine: the trainer and the rollout engine apart, as
in a disaggregated setup, with weights arriving through shared memory.

    proc = EngineProcess(model, seed=0, dtype=torch.bfloat16)
    completions = proc.generate(requests)        # runs in the child, same results as in-process
    sync = build_sync(cfg.sync, trainer, proc)   # full or sparse payloads via shared memory
    proc.close()

The child builds the model skeleton from the parent's config without initialising it (meta
device), copies the parent's buffers, and receives every weight as a verified full payload, so
it holds bit for bit what an in-process `BuiltinEngine(model)` would. The built-in backend
(rollwise.engine.backends.builtin) picks in-process or child process from `sync.transport`.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import traceback

import torch

from rollwise.engine.base import Completion, Engine, Request
from rollwise.engine.builtin import BuiltinEngine
from rollwise.sync.errors import BY_NAME, EngineProcessError, SyncError
from rollwise.sync.payload import dtype_name, from_wire, pack_meta, to_dtype, to_wire, unpack_meta
from rollwise.sync.receiver import Ack, EngineState, Receiver
from rollwise.sync.sender import Sender
from rollwise.sync.transport import GrowingBuffer, ProcessTransport, SharedArena
from rollwise.training import packed_attention
from rollwise.waits import STARTUP_S, NoAnswer, Peer, PeerDied, answers, bounded, deliver


class EngineProcess(Engine):
    """The built-in Engine, hosted in a child process. Exposes `generate`, `version`,
    `tokens_generated`, `load_weights` and `call(method, ...)` for any other engine method.

    `wire` is how payload bytes reach the child: "shm", a shared-memory arena both map (no
    copy, needs /dev/shm as large as the model), or "socket", copied through the pipe's Unix
    socket (no shared memory; every byte moves, as over a network)."""

    can_keep_paused = True  # pause(keep=True) and find_paused run in the child's engine

    def __init__(self, model, *, dtype: torch.dtype | None = None, threads: int | None = None,
                 version: int = 0, wire: str = "shm", timeout_s: float = 1800.0,
                 **engine_kwargs):
        """timeout_s: the longest any call waits for the child's answer (loop.wait_timeout_s);
        past it the child is killed and the error names it."""
        if wire not in ("shm", "socket"):
            raise ValueError(f"engine process wire {wire!r}: use 'shm' or 'socket'")
        self.wire, self.timeout_s, self._gone = wire, timeout_s, ""
        self._local = GrowingBuffer()  # the socket wire's arena, in this process
        ctx = mp.get_context("spawn")  # fork would copy a threaded torch runtime
        self._conn, child = ctx.Pipe()
        init = {"cls": type(model), "config": packed_attention.portable(model.config),
                "buffers": {n: to_wire(b) for n, b in model.named_buffers()},
                "dtype": None if dtype is None else dtype_name(dtype),
                "threads": threads or torch.get_num_threads(), "engine_kwargs": engine_kwargs}
        self._arena: SharedArena | None = None
        self.tokens_generated = self.answers_finished = 0  # the child's, after each call
        self._version = -1
        self._proc = ctx.Process(target=_child_main, args=(child, init), daemon=True,
                                 name="rollwise-engine")
        try:
            self._proc.start()
        except BaseException:
            self._proc = None
            raise
        finally:
            child.close()  # else this process holds the pipe's other end: no EOF if it dies
        try:
            self._recv(STARTUP_S, "start (build its model)", setting="",
                       hint="the usual cause of a hang here is a script without an `if "
                       "__name__ == '__main__':` guard: the spawned child imports it and runs "
                       "it again")
        except BaseException:
            if self._proc is not None:  # it did not start: nothing to close gracefully
                self._abandon()
            raise
        self.load_weights(model.state_dict(), version)

    # --- the engine's interface -------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[Request]) -> list[Completion]:
        return self.call("generate", requests)

    # the base class's methods, forwarded (its defaults would answer here, not the child)
    def add(self, request: Request) -> int:
        return self.call("add", request)

    def step(self):
        return self.call("step")

    def has_unfinished(self) -> bool:
        return self.call("has_unfinished")

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache")

    def release_idle_memory(self) -> bool:
        return self.call("release_idle_memory")

    def use_adapters(self, spec) -> None:
        self.call("use_adapters", spec)

    def sync_transport(self) -> ProcessTransport:
        return ProcessTransport(self)

    def state_dict(self) -> dict:
        return self.call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self.call("load_state_dict", state)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Full, verified load of these weights (cast to the engine's dtypes)."""
        state = self.sync_state()
        sender = Sender(state.spec, keep_mirror=False, with_checksum=True, bucket_bytes=2**62)
        meta, _ = sender.encode(state_dict, version, self.arena, full=True)
        self.apply(meta)

    def stream(self):
        """Step until nothing is waiting or running, yielding events (one call per step: a
        generator cannot cross the process boundary)."""
        while self.call("has_unfinished"):
            yield from self.call("step")

    def call(self, method: str, *args, **kwargs):
        """Any method of the engine, run in the child (arguments and result pickled)."""
        out, self.tokens_generated, self.answers_finished, self._version = self._call(
            "call", method, args, kwargs)
        return out

    def __getattr__(self, name: str):
        """The built-in engine's other public methods (pause, fork, ...) run in the child."""
        if name == "model":
            raise AttributeError("the engine's model lives in a child process; read its weights"
                                 " with ProcessTransport(proc).engine_weights()")
        if not name.startswith("_") and callable(getattr(BuiltinEngine, name, None)):
            return functools.partial(self.call, name)
        raise AttributeError(f"EngineProcess has no attribute {name!r}; only the engine's "
                             f"methods are forwarded to the child process")

    # --- the weight-sync side ---------------------------------------------------------------
    def sync_state(self) -> EngineState:
        state = self._call("state")
        self._version = state.version
        return state

    def arena(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the arena: shared memory, grown (and the child told) when too small; on
        the socket wire, a buffer in this process."""
        if self.wire == "socket":
            return self._local.take(nbytes)
        if self._arena is None or self._arena.nbytes < nbytes:
            self._check_alive()  # before making a segment only a live child would map
            grown = SharedArena(max(nbytes, int(1.25 * self._arena.nbytes) if self._arena else 0))
            try:
                self._call("attach", grown.name, grown.nbytes)
            except BaseException:  # the child never mapped it: unlink it, or /dev/shm keeps it
                grown.close()
                raise
            old, self._arena = self._arena, grown
            if old is not None:
                old.close()
        return self._arena.tensor[:nbytes]

    def apply(self, meta) -> Ack:
        try:
            if self.wire == "socket":
                self._send("apply_bytes", pack_meta(meta), meta.nbytes)
                self._send_bytes(self._local.take(meta.nbytes))
                ack = self._recv(self.timeout_s, "apply a weight payload")
            else:
                ack = self._call("apply", pack_meta(meta))
        except SyncError:
            self.sync_state()  # the child may have marked its weights unknown (version -1)
            raise
        self._version = ack.version
        return ack

    def export(self):
        """(meta, arena): the child's weights as a full payload in the shared arena."""
        spec = self.sync_state().spec
        if self.wire == "socket":
            meta = self._call("export_bytes")
            arena = self._local.take(meta.nbytes)
            self._bounded(lambda: self._conn.recv_bytes_into(arena.numpy()),
                          "send its weights")
            return meta, arena
        self.arena(sum(s.nbytes for s in spec.values()) + 256 * len(spec) * 8)
        return self._call("export"), self._arena.tensor

    # --- process plumbing -------------------------------------------------------------------
    def _call(self, cmd: str, *args):
        self._send(cmd, *args)
        return self._recv(self.timeout_s, f"answer {args[0] if cmd == 'call' else cmd!r}")

    def _send(self, cmd: str, *args) -> None:
        self._deliver((cmd, args), "take its message")

    def _send_bytes(self, data: torch.Tensor) -> None:
        self._deliver(data.numpy(), "take a weight payload", raw=True)

    def _check_alive(self) -> None:
        if self._proc is None:
            raise EngineProcessError(self._gone or "the engine process is closed")

    def _deliver(self, message, what: str, raw: bool = False) -> None:
        self._check_alive()
        try:
            deliver([self._peer()], [message], what, self.timeout_s, raw=raw)
        except (NoAnswer, PeerDied) as e:
            raise self._failed(e) from None

    def _bounded(self, call, what: str):
        try:
            return bounded([call], [self._peer()], what, self.timeout_s)[0]
        except (NoAnswer, PeerDied) as e:
            raise self._failed(e) from None

    def _recv(self, timeout_s: float | None = None, waiting: str = "answer",
              setting: str = "loop.wait_timeout_s", hint: str = ""):
        """The child's reply, within timeout_s (None: while it lives; a generate call may be
        long); a dead child raises at once, not at the timeout."""
        try:
            (reply,) = answers([self._peer()], waiting, timeout_s, setting)
        except (NoAnswer, PeerDied) as e:
            raise self._failed(e, hint) from None
        if reply[0] == "ok":
            return reply[1]
        _, name, message, tb = reply
        if name in BY_NAME:
            raise BY_NAME[name](message)
        raise EngineProcessError(f"{name} in the engine process: {message}\n{tb}")

    def _peer(self) -> Peer:
        return Peer("the engine process", self._proc, self._conn)

    def _failed(self, e: NoAnswer | PeerDied, hint: str = "") -> EngineProcessError:
        if isinstance(e, PeerDied):
            return EngineProcessError(f"{e}; a killed process (-9) usually means out of memory")
        why = f"{e}; it was killed" + (f"; {hint}" if hint else "")
        self._abandon(why)  # a late answer would be read as the next call's
        return EngineProcessError(why)

    def _abandon(self, why: str = "") -> None:
        """Kill a child that stopped answering; every later call says why it is gone."""
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()
        self._proc, self._gone = None, why
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("close", ()))
            if self._conn.poll(10):
                self._conn.recv()
        except (EOFError, OSError):
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._proc = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def build_engine_in_child(init: dict) -> BuiltinEngine:
    """The built-in engine a child process (or a Ray worker) hosts: the model skeleton built
    from the parent's config without initialising it, the parent's buffers copied, version
    -1 until the first full payload brings the weights."""
    torch.set_num_threads(init["threads"])
    with torch.device("meta"):  # the weights come in the first full payload
        model = init["cls"](init["config"])
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties shared parameters
    own = dict(model.named_buffers())
    with torch.no_grad():
        for name, w in init["buffers"].items():
            own[name].copy_(from_wire(w))
    if init["dtype"] is not None:
        model.to(to_dtype(init["dtype"]))
    model.eval().requires_grad_(False)  # as BuiltinEngine(copy_model=True) leaves its copy
    engine = BuiltinEngine(model, copy_model=False, **init["engine_kwargs"])
    engine.version = -1  # no weights yet
    return engine


def _child_main(conn, init: dict) -> None:
    try:
        engine = build_engine_in_child(init)
        receiver = Receiver(engine)
        conn.send(("ok", None))
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        return
    arena: SharedArena | None = None
    received = GrowingBuffer()  # the socket wire's payloads
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if cmd == "close":
            conn.send(("ok", None))
            break
        try:
            if cmd == "attach":
                if arena is not None:
                    arena.close()
                arena = SharedArena(args[1], name=args[0])
                out = None
            elif cmd == "state":
                out = receiver.state()
            elif cmd == "apply":
                out = receiver.apply(unpack_meta(args[0]), arena.tensor)
            elif cmd == "apply_bytes":  # the payload's bytes follow on the pipe
                data = received.take(args[1])
                conn.recv_bytes_into(data.numpy())
                out = receiver.apply(unpack_meta(args[0]), data)
            elif cmd == "export":
                out, _ = receiver.export(lambda n: arena.tensor[:n])
            elif cmd == "export_bytes":  # the metadata, then the bytes
                out, data = receiver.export(received.take)
                conn.send(("ok", out))
                conn.send_bytes(data.numpy())
                continue
            elif cmd == "call":
                out = (getattr(engine, args[0])(*args[1], **args[2]), engine.tokens_generated,
                       engine.answers_finished, engine.version)
            else:
                raise ValueError(f"unknown engine-process command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    if arena is not None:
        arena.close()
