"""Worker processes for isolated verifiers: items are scored one at a time with a per-sample
timeout. A worker that overruns is killed (its sample fails with `timeout`) and replaced; one
that dies fails its sample with `crash`; the rest of its queue moves to a fresh worker.

Workers are fresh interpreters (`python -m rollwise.stages.filter.pool`; never forked: the
trainer holds torch threads, and unlike multiprocessing's spawn they never re-run the
caller's main script). They receive sys.path and the verifiers once, over a pipe, serialised
with cloudpickle (a reward defined in the caller's script goes by value), and live until
`close()` or the end of the parent (their pipe closes, they exit).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait

import cloudpickle

from rollwise.stages.filter.base import (
    BAD_OUTPUT,
    CRASH,
    DEADLINE,
    ERROR,
    TIMEOUT,
    Item,
    Verdict,
    coerce,
)

STARTUP_TIMEOUT_S = 120.0
PROGRESS_S = 10.0  # how often a long run of jobs reports its progress


def _worker(rx: Connection, tx: Connection) -> None:
    path, payload = rx.recv()
    sys.path[:] = path  # the parent's, so user verifiers import the same way
    verifiers = pickle.loads(payload)
    for v in verifiers.values():
        v.in_worker = True  # e.g. math-verify: no signal.alarm, the pool times us out
        try:  # imports happen before "ready", so they never count against a sample's time
            v.warm()
        except Exception:
            pass  # the sample will fail with the reason when it is scored
    tx.send("ready")
    while True:
        try:
            chunk = rx.recv()
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
                tx.send((idx, verdict))
            except Exception as e:  # e.g. an unpicklable info object
                tx.send((idx, Verdict.failure(BAD_OUTPUT, f"{name}: {e}")))


class _Worker:
    def __init__(self, payload: bytes):
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollwise.stages.filter.pool", str(from_parent),
             str(to_parent)], pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        self.send_conn, self.conn = Connection(to_child, readable=False), Connection(from_child,
                                                                                     writable=False)
        self.send_conn.send((list(sys.path), payload))
        self.inflight: deque[tuple[int, str, Item]] = deque()
        self.deadline = float("inf")

    def send(self, obj) -> None:
        self.send_conn.send(obj)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self.conn.close()
        self.send_conn.close()


class VerifierPool:
    def __init__(self, verifiers: dict, workers: int, timeout_s: float):
        try:
            self.payload = cloudpickle.dumps(verifiers)
        except Exception as e:
            raise ValueError(f"a verifier cannot be sent to worker processes ({e}); set "
                             "filter.workers=0 to run verifiers in-process") from e
        self.n, self.timeout_s = workers, timeout_s
        self.workers: list[_Worker] = []
        self.restarts = 0

    def _spawn(self) -> _Worker:
        w = _Worker(self.payload)
        if not w.conn.poll(STARTUP_TIMEOUT_S) or w.conn.recv() != "ready":
            w.kill()
            raise RuntimeError("a verifier worker did not start")
        return w

    def start(self) -> None:
        while len(self.workers) < self.n:
            self.workers.append(self._spawn())

    def run(self, jobs: list[tuple[str, Item]], deadline: float | None = None,
            on_progress=None) -> list[Verdict]:
        """Verdicts for (verifier name, item) jobs, in order. Past `deadline` (a monotonic
        time), the jobs not scored yet fail with DEADLINE and the busy workers are replaced;
        on_progress(done, total) at most every PROGRESS_S while it runs."""
        self.start()
        results: list[Verdict | None] = [None] * len(jobs)
        queue = deque((i, name, item) for i, (name, item) in enumerate(jobs))
        chunk = max(1, min(16, len(jobs) // (4 * self.n)))
        said = time.monotonic()
        while queue or any(w.inflight for w in self.workers):
            if deadline is not None and time.monotonic() > deadline:
                self._give_up(results, queue)
                break
            for w in self.workers:
                if not w.inflight and queue:
                    w.inflight.extend(queue.popleft() for _ in range(min(chunk, len(queue))))
                    w.send(list(w.inflight))
                    w.deadline = time.monotonic() + self.timeout_s
            busy = [w for w in self.workers if w.inflight]
            wake = min([w.deadline for w in busy] + ([deadline] if deadline else []))
            ready = wait([w.conn for w in busy], max(0.0, min(wake - time.monotonic(),
                                                              PROGRESS_S)))
            for w in busy:  # a dead worker's pipe is readable
                if w.conn in ready:
                    self._receive(w, results, queue)
            for w in list(self.workers):
                if w.inflight and time.monotonic() > w.deadline:
                    idx, name, _ = w.inflight.popleft()
                    results[idx] = Verdict.failure(TIMEOUT, f"{name}: no verdict within "
                                                            f"{self.timeout_s:g} s")
                    self._replace(w, queue)
            if on_progress is not None and time.monotonic() - said >= PROGRESS_S:
                on_progress(sum(r is not None for r in results), len(jobs))
                said = time.monotonic()
        return results  # type: ignore[return-value]

    def _give_up(self, results: list, queue: deque) -> None:
        for w in list(self.workers):
            if w.inflight:
                queue.extend(w.inflight)
                w.inflight.clear()
                self._replace(w, deque())
        for idx, name, _ in queue:
            results[idx] = Verdict.failure(DEADLINE, f"{name}: not scored before the "
                                                     f"deadline")
        queue.clear()

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
                code = w.proc.wait(5)
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
                w.send(None)
                w.proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            w.kill()
        self.workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


if __name__ == "__main__":
    _worker(Connection(int(sys.argv[1]), writable=False),
            Connection(int(sys.argv[2]), readable=False))
