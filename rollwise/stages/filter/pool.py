"""Worker processes for isolated verifiers: items are scored one at a time with a per-sample
timeout. A worker that overruns is killed (its sample fails with `timeout`) and replaced; one
that dies fails its sample with `crash`; the rest of its queue moves to a fresh worker.

Workers are spawned (never forked: the trainer holds torch threads), receive the verifiers
once, and live until `close()` or the end of the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from collections import deque
from multiprocessing.connection import wait

from rollwise.stages.filter.base import BAD_OUTPUT, CRASH, ERROR, TIMEOUT, Item, Verdict, coerce

STARTUP_TIMEOUT_S = 120.0


def _worker(conn, payload: bytes) -> None:
    verifiers = pickle.loads(payload)
    for v in verifiers.values():
        if hasattr(v, "in_worker"):
            v.in_worker = True  # e.g. math-verify: no signal.alarm, the pool times us out
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for idx, name, item in chunk:
            try:
                out = verifiers[name].score([item])
                verdict = coerce(out[0], name) if isinstance(out, list) and len(out) == 1 else \
                    Verdict.failure(BAD_OUTPUT, f"{name}: returned {type(out).__name__}, "
                                                "expected a list of one verdict")
            except Exception as e:
                verdict = Verdict.failure(ERROR, f"{name}: {type(e).__name__}: {e}")
            try:
                conn.send((idx, verdict))
            except Exception as e:  # e.g. an unpicklable info object
                conn.send((idx, Verdict.failure(BAD_OUTPUT, f"{name}: {e}")))


class _Worker:
    def __init__(self, ctx, payload: bytes):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, payload), daemon=True)
        self.proc.start()
        child.close()
        self.inflight: deque[tuple[int, str, Item]] = deque()
        self.deadline = float("inf")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class VerifierPool:
    def __init__(self, verifiers: dict, workers: int, timeout_s: float):
        try:
            self.payload = pickle.dumps(verifiers)
        except Exception as e:
            raise ValueError(f"a verifier cannot be sent to worker processes ({e}); set "
                             "filter.workers=0 to run verifiers in-process") from e
        self.n, self.timeout_s = workers, timeout_s
        self.ctx = mp.get_context("spawn")
        self.workers: list[_Worker] = []
        self.restarts = 0

    def _spawn(self) -> _Worker:
        w = _Worker(self.ctx, self.payload)
        if not w.conn.poll(STARTUP_TIMEOUT_S) or w.conn.recv() != "ready":
            w.kill()
            raise RuntimeError("a verifier worker did not start")
        return w

    def start(self) -> None:
        while len(self.workers) < self.n:
            self.workers.append(self._spawn())

    def run(self, jobs: list[tuple[str, Item]]) -> list[Verdict]:
        """Verdicts for (verifier name, item) jobs, in order."""
        self.start()
        results: list[Verdict | None] = [None] * len(jobs)
        queue = deque((i, name, item) for i, (name, item) in enumerate(jobs))
        chunk = max(1, min(16, len(jobs) // (4 * self.n)))
        while queue or any(w.inflight for w in self.workers):
            for w in self.workers:
                if not w.inflight and queue:
                    w.inflight.extend(queue.popleft() for _ in range(min(chunk, len(queue))))
                    w.conn.send(list(w.inflight))
                    w.deadline = time.monotonic() + self.timeout_s
            busy = [w for w in self.workers if w.inflight]
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout)
            for w in busy:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._receive(w, results, queue)
            for w in list(self.workers):
                if w.inflight and time.monotonic() > w.deadline:
                    idx, name, _ = w.inflight.popleft()
                    results[idx] = Verdict.failure(TIMEOUT, f"{name}: no verdict within "
                                                            f"{self.timeout_s:g} s")
                    self._replace(w, queue)
        return results  # type: ignore[return-value]

    def _receive(self, w: _Worker, results: list, queue: deque) -> None:
        try:
            while w.conn.poll():
                idx, verdict = w.conn.recv()
                w.inflight.popleft()
                results[idx] = verdict
                w.deadline = time.monotonic() + self.timeout_s
        except (EOFError, OSError):
            if w.inflight:
                idx, name, _ = w.inflight.popleft()
                code = w.proc.exitcode
                results[idx] = Verdict.failure(CRASH, f"{name}: the worker died (exit {code})")
            self._replace(w, queue)

    def _replace(self, w: _Worker, queue: deque) -> None:
        queue.extendleft(reversed(w.inflight))
        w.inflight.clear()
        w.kill()
        self.workers.remove(w)
        self.restarts += 1
        self.workers.append(self._spawn())

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(2)
            if w.proc.is_alive():
                w.kill()
        self.workers = []
