"""Bounded waits on other processes. Every wait for another process (the engine's child, the
trainer's ranks on pipes or as Ray actors, Ray rollout workers) goes through here, so each has
a deadline, a peer that dies is reported at once rather than at the deadline, and the error
names the process that did not answer, with its state, never the one waiting on it: a stopped
peer (SIGSTOP, a debugger) is named first, since the others may only be waiting for it in a
collective.

    peers = [Peer("trainer rank 0", proc0, conn0), Peer("trainer rank 1", proc1, conn1)]
    deliver(peers, messages, "take 'update'", timeout_s)   # a full pipe blocks only a thread
    replies = answers(peers, "finish 'update'", timeout_s)  # NoAnswer / PeerDied, named
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

STARTUP_S = 300.0  # the least a process that imports torch and builds a model gets to start
POLL_S = 0.2  # how often a wait looks at whether its peers still live
STOPPED = ("T", "t")  # /proc state letters of a stopped or traced process


class NoAnswer(TimeoutError):
    """Peers that did not answer within the bound. `peers` are their descriptions, a stopped
    one first; `stopped` says whether any is stopped."""

    def __init__(self, peers: list[str], what: str, timeout_s: float, stopped: bool = False,
                 setting: str = "loop.wait_timeout_s"):
        self.peers, self.stopped = peers, stopped
        note = ("; a stopped process answers nothing, and the others may only be waiting "
                "for it" if stopped else "")
        bound = f"{timeout_s:.0f}s ({setting})" if setting else f"{timeout_s:.0f}s"
        super().__init__(f"{', '.join(peers)} did not {what} within {bound}{note}")


class PeerDied(RuntimeError):
    """A peer died while it was waited on."""

    def __init__(self, peer: str, how: str):
        self.peer, self.how = peer, how
        super().__init__(f"{peer} died ({how})")


@dataclass
class Peer:
    """Another process waited on: how errors name it, the process, and its end of a pipe."""
    name: str  # "the engine process", "trainer rank 1"
    proc: object  # a multiprocessing.Process
    conn: Connection | None = None

    def describe(self) -> str:
        state = process_state(self.proc.pid)
        shown = "stopped (SIGSTOP or a debugger)" if state in STOPPED else f"state {state}"
        return f"{self.name} (pid {self.proc.pid}, {shown})"

    def died(self) -> PeerDied:
        self.proc.join(timeout=5)
        return PeerDied(self.name, f"exit code {self.proc.exitcode}")


def answers(peers: list[Peer], what: str, timeout_s: float | None,
            setting: str = "loop.wait_timeout_s") -> list:
    """The next message from each peer, in their order, within timeout_s (None: as long as
    they live). A peer that dies first raises PeerDied; silence past the bound, NoAnswer
    (`setting`: the configuration that sets the bound, named in the error; "" for none)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    got: dict[int, object] = {}
    while len(got) < len(peers):
        pending = {peers[i].conn: i for i in range(len(peers)) if i not in got}
        for conn in wait(list(pending), timeout=POLL_S):
            got[pending[conn]] = _receive(peers[pending[conn]])
        for i in pending.values():
            if i not in got and not peers[i].proc.is_alive():
                got[i] = _receive(peers[i])  # its answer may have come just before its end
        if deadline is not None and time.monotonic() > deadline and len(got) < len(peers):
            raise silent([p for i, p in enumerate(peers) if i not in got], what, timeout_s,
                         setting)
    return [got[i] for i in range(len(peers))]


def _receive(peer: Peer):
    try:
        if peer.conn.poll():
            return peer.conn.recv()
    except (EOFError, OSError):
        pass
    raise peer.died() from None


def deliver(peers: list[Peer], messages: list, what: str, timeout_s: float,
            raw: bool = False) -> None:
    """Send each peer its message (raw: a buffer, with send_bytes) within the bound."""
    def send(peer: Peer, message) -> None:
        peer.conn.send_bytes(message) if raw else peer.conn.send(message)

    bounded([functools.partial(send, p, m) for p, m in zip(peers, messages)], peers, what,
            timeout_s)


def bounded(calls: list[Callable], peers: list[Peer], what: str, timeout_s: float) -> list:
    """Each peer's pipe call (a send, or reading a large message) in its own thread, so a
    peer that stopped reading or writing blocks that thread, never the caller. Their results
    in order; a broken pipe is PeerDied, a call unfinished at the bound NoAnswer (the caller
    kills that peer, which ends the thread)."""
    results: dict[int, object] = {}
    broken: dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except (EOFError, OSError) as e:
            broken[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if broken:
        raise peers[min(broken)].died()
    late = [p for p, t in zip(peers, threads) if t.is_alive()]
    if late:
        raise silent(late, what, timeout_s)
    return [results[i] for i in range(len(calls))]


def silent(peers: list[Peer], what: str, timeout_s: float,
           setting: str = "loop.wait_timeout_s") -> NoAnswer:
    """NoAnswer for these peers, a stopped one first."""
    states = {id(p): process_state(p.proc.pid) for p in peers}
    ordered = sorted(peers, key=lambda p: states[id(p)] not in STOPPED)
    stopped = any(s in STOPPED for s in states.values())
    return NoAnswer([p.describe() for p in ordered], what, timeout_s, stopped, setting)


def process_state(pid: int) -> str:
    """The process's state letter from /proc (R running, S sleeping, T stopped, ...), or '?'
    where /proc is not there."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
