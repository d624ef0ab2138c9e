"""One thread that owns the engine while it serves: requests from any thread (HTTP handlers,
agent episodes) are queued, added to the engine between steps and batched together, and each
request's events are handed back to whoever waits on it. The engine itself is never touched
from two threads.

    driver = EngineDriver(engine, gate=rollout.gate)
    stream = driver.submit(prompt_ids, params, on_event=handle)   # thread-safe
    driver.close()          # handle(event) is called from the engine's thread, for each event

`gate`: the asynchronous loop's WeightGate, held for each engine step and its events, as the
rollout driver does, so a weight push lands between steps and every token carries the version
that sampled it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from contextlib import nullcontext

from rollwise.engine import Request, SamplingParams
from rollwise.engine.scheduler import Event

IDLE_WAIT_S = 0.05  # how long the idle driver waits for a request before it looks again
BURST_S, BURST_GAP_S = 0.5, 0.01  # an idle engine gathers a burst of requests (see _settle)


class EngineStopped(RuntimeError):
    """The driver was closed or its engine failed; the message says which."""


class RequestRefused(ValueError):
    """The engine refused one request (one that can never fit its K/V budget); the others go
    on."""


class Stream:
    """One request's events, as the driver hands them over."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tag, on_event):
        """on_event: called from the engine's thread with each event, or with the exception
        that ended the request (an asyncio handler passes loop.call_soon_threadsafe here)."""
        self.prompt_ids, self.params, self.tag = prompt_ids, params, tag
        self.put = on_event
        self.seq_id: int | None = None
        self.sent = 0  # tokens handed over so far
        self.cancelled = False

    def cancel(self) -> None:
        """The caller is gone (a closed stream, a stop string met): abort it at the next step."""
        self.cancelled = True


class EngineDriver:
    """own_thread: step the engine in a thread of its own (a server with nothing else to do);
    else the thread that owns the engine steps it by calling `pump` (an agent round, from the
    run's own thread: engines bound to the thread that built them, as vLLM's CPU attention
    is, stay there)."""

    def __init__(self, engine, gate=None, own_thread: bool = True,
                 name: str = "rollwise-serve-engine"):
        self.engine, self.gate = engine, gate
        self._inbox: queue.Queue[Stream] = queue.Queue()
        self._live: dict[int, Stream] = {}
        self._closed = threading.Event()
        self._failure: BaseException | None = None
        self._ids = itertools.count()
        self._thread = None
        if own_thread:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event,
               tag=None) -> Stream:
        if self._failure is not None:
            raise EngineStopped(f"the engine failed: {self._failure}")
        if self._closed.is_set():
            raise EngineStopped("the engine is not serving (closed)")
        stream = Stream(list(prompt_ids), params, next(self._ids) if tag is None else tag,
                        on_event)
        self._inbox.put(stream)
        return stream

    @property
    def busy(self) -> bool:
        return bool(self._live) or not self._inbox.empty()

    def pump(self) -> None:
        """One turn of the engine, from the calling thread: take what came (waiting up to
        IDLE_WAIT_S when idle), then one step. An engine failure is told to every waiter and
        raised here."""
        try:
            self._admit(block=not self._live)
            if self._live:
                self._step()
        except BaseException as e:
            self._failure = e
            self._stop_all()
            raise

    def stop(self) -> int:
        """Begin closing without waiting (a signal handler's part): the engine ends its step,
        then aborts every request (their waiters get EngineStopped). Returns how many
        were running or queued (one per choice)."""
        n = len(self._live) + self._inbox.qsize()
        self._closed.set()
        return n

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving: requests still running are aborted (their waiters get EngineStopped);
        returns once the engine is idle."""
        self._closed.set()
        if self._thread is None:
            self._stop_all()
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the serving engine's thread did not stop within {timeout_s:.0f}s")

    # --- the engine's turns -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self.pump()
        except BaseException:  # told to every waiter by pump
            pass
        finally:
            self._stop_all()

    def _admit(self, block: bool) -> None:
        try:
            first = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        if block:  # an idle engine's first request often opens a burst (a round of agents
            self._settle()  # starting): prefill the burst together, not one request at a time
        for stream in [first, *self._drain()]:
            try:
                stream.seq_id = self.engine.add(Request(stream.prompt_ids, stream.params,
                                                        stream.tag))
            except ValueError as e:  # this request's own fault: the engine serves on
                stream.put(RequestRefused(str(e)))
                continue
            self._live[stream.seq_id] = stream

    def _settle(self) -> None:
        """Wait (at most BURST_S) until no request has come for BURST_GAP_S."""
        deadline, seen = time.monotonic() + BURST_S, self._inbox.qsize()
        while time.monotonic() < deadline:
            time.sleep(BURST_GAP_S)
            now = self._inbox.qsize()
            if now == seen:
                return
            seen = now

    def _drain(self) -> list[Stream]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _step(self) -> None:
        with self.gate.shared() if self.gate is not None else nullcontext():
            for seq_id, stream in list(self._live.items()):
                if stream.cancelled and hasattr(self.engine, "abort"):
                    self._deliver(self._aborted(seq_id, stream))
            if self._live:
                for ev in self.engine.step():
                    self._deliver(ev)

    def _aborted(self, seq_id: int, stream: Stream) -> Event:
        """The sequence stopped for good; its last event carries the tokens not yet sent."""
        c = self.engine.abort(seq_id)
        n = stream.sent
        return Event(seq_id, stream.tag, c.token_ids[n:], c.logprobs[n:], c.entropies[n:],
                     c.versions[n:], True, "abort")

    def _deliver(self, ev: Event) -> None:
        stream = self._live.get(ev.seq_id)
        if stream is None:
            return
        if ev.finished:
            del self._live[ev.seq_id]
        stream.sent += len(ev.token_ids)
        stream.put(ev)

    def _stop_all(self) -> None:
        why = EngineStopped(f"the engine failed: {self._failure}" if self._failure is not None
                            else "the engine stopped serving (closed)")
        for seq_id, stream in list(self._live.items()):
            if hasattr(self.engine, "abort") and self._failure is None:
                try:
                    self.engine.abort(seq_id)
                except Exception:
                    pass
            stream.put(why)
        self._live.clear()
        for stream in self._drain():
            stream.put(why)
