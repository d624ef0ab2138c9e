"""Bounded waits on other processes (rollwise.waits), with real processes and real signals."""

import multiprocessing as mp
import os
import signal
import time

import pytest

from rollwise.waits import NoAnswer, Peer, PeerDied, answers, deliver

CTX = mp.get_context("fork")


def _echo(conn, delay_s):
    msg = conn.recv()
    time.sleep(delay_s)
    conn.send(("echo", msg))
    conn.recv()  # then wait to be told to end


def _answer_and_exit(conn):
    conn.send("done")


def _never_read(conn):
    time.sleep(60)


def _exit_at_once(conn):
    os._exit(3)


def _peer(name, target, *args):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return Peer(name, proc, parent)


@pytest.fixture
def peers():
    made = []
    yield lambda *a: made.append(_peer(*a)) or made[-1]
    for p in made:
        if p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(5)


def test_answers_come_back_in_the_peers_order(peers):
    slow, fast = peers("slow", _echo, 0.3), peers("fast", _echo, 0.0)
    deliver([slow, fast], ["a", "b"], "take it", 5)
    assert answers([slow, fast], "answer", 5) == [("echo", "a"), ("echo", "b")]


def test_a_stopped_peer_is_named_first_within_the_bound(peers):
    """Rank 0 waits (here: it never got its message answered), rank 1 is stopped: the error
    names rank 1 as stopped first, then rank 0, and comes at the bound, not later."""
    waiting, stopped = peers("rank 0", _never_read), peers("rank 1", _never_read)
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(NoAnswer) as e:
        answers([waiting, stopped], "finish 'update'", 1.0)
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert e.value.stopped
    assert e.value.peers[0] == f"rank 1 (pid {stopped.proc.pid}, stopped (SIGSTOP or a debugger))"
    assert e.value.peers[1].startswith(f"rank 0 (pid {waiting.proc.pid}, state ")
    assert "did not finish 'update' within 1s" in str(e.value)


def test_a_peer_that_dies_is_reported_at_once_not_at_the_bound(peers):
    gone = peers("the engine process", _exit_at_once)
    t0 = time.monotonic()
    with pytest.raises(PeerDied, match=r"the engine process died \(exit code 3\)"):
        answers([gone], "answer", 30)
    assert time.monotonic() - t0 < 10


def test_an_answer_sent_just_before_the_peer_ended_is_read_not_called_a_death(peers,
                                                                              monkeypatch):
    """The interleaving: the wait for readable pipes returns empty, then the peer answers and
    exits before its liveness is checked. Its answer is read, not reported as a death."""
    import rollwise.waits as waits
    p = peers("tool", _answer_and_exit)
    p.proc.join(5)
    monkeypatch.setattr(waits, "wait", lambda conns, timeout: [])  # the answer came after
    assert answers([p], "answer", 5) == ["done"]


def test_a_peer_that_stops_reading_blocks_a_thread_not_the_caller(peers):
    """A message larger than the pipe's buffer to a peer that never reads: deliver returns
    NoAnswer at the bound instead of blocking in send."""
    deaf = peers("trainer rank 1", _never_read)
    os.kill(deaf.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(NoAnswer, match="trainer rank 1 .*stopped.* did not take its message"):
        deliver([deaf], [b"x" * (8 << 20)], "take its message", 1.0, raw=True)
    assert time.monotonic() - t0 < 3.0


def test_no_bound_waits_while_the_peer_lives(peers):
    slow = peers("slow", _echo, 1.0)
    deliver([slow], ["a"], "take it", 5)
    assert answers([slow], "answer", None) == [("echo", "a")]
