"""The scheduler alone, driven with fabricated model outputs (no model, no torch)."""

import random
from dataclasses import dataclass

import pytest

from rollwise.engine.scheduler import Scheduler, SeqStatus, Sequence, StepOutput


@dataclass(frozen=True)
class P:  # the two SamplingParams fields the scheduler reads
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()


_ids = iter(range(10**6))


def seq(prompt_len: int = 3, max_new: int = 4, stop=(), first: int | None = None) -> Sequence:
    """A sequence with a prompt of its own (unless `first` makes prompts equal)."""
    i = next(_ids)
    first = 1000 * i if first is None else first
    return Sequence(i, None, list(range(first, first + prompt_len)), P(max_new, stop))


def fake_step(s: Scheduler, token=lambda seq: 1):
    """schedule() and update() with one fabricated token per sampled row."""
    plan = s.schedule()
    assert [q.slot for q in plan.decode] == list(range(len(plan.decode)))  # packed low
    toks = [token(q) for q in plan.sequences]
    n = len(toks)
    events = s.update(plan, StepOutput(toks, [-0.5] * n, [1.0] * n, version=7))
    return plan, events


def check_invariants(s: Scheduler) -> None:
    """After a step: slots unique and accounted for, the cache shape within the budget and
    covering every sequence, each one's cache filled up to its pending token."""
    slots = [q.slot for q in s.running.values()]
    assert len(set(slots)) == len(slots)  # no slot shared
    assert not set(slots) & set(s.free_slots)
    assert len(slots) + len(s.free_slots) == s.max_slots
    assert all(q.slot < s.cache_rows and q.reservation <= s.cache_len for q in s.running.values())
    if s.kv_budget_tokens is not None:
        assert s.cache_rows * s.cache_len <= s.kv_budget_tokens
    for q in s.running.values():
        assert q.cached in (0, len(q.prompt) + len(q.tokens) - 1)


def test_a_finished_sequence_frees_its_slot_for_a_waiting_one_at_once():
    s = Scheduler(2)
    short, long_, waiting = seq(max_new=2), seq(max_new=6), seq(max_new=3)
    for q in (short, long_, waiting):
        s.add(q)
    plan, _ = fake_step(s)
    assert plan.prefill == [short, long_] and waiting.status is SeqStatus.WAITING
    plan, events = fake_step(s)  # short ends here
    assert plan.decode == [short, long_]
    assert [e.seq_id for e in events if e.finished] == [short.seq_id]
    plan, _ = fake_step(s)  # the very next step prefills the waiting one beside the long one
    assert plan.decode == [long_] and plan.prefill == [waiting]
    # running sequences are kept in the lowest slots: the long one moved into the freed slot 0
    assert plan.copies == [(1, 0, 4)] and long_.slot == 0 and waiting.slot == 1
    check_invariants(s)


def test_stop_id_and_length_finish_with_reason():
    s = Scheduler(4, segment=100)
    a, b = seq(max_new=5, stop=(9,)), seq(max_new=3, stop=(9,))
    s.add(a), s.add(b)
    finished = {}
    for step in range(5):
        _, events = fake_step(s, token=lambda q: 9 if q is a and len(q.tokens) == 1 else 2)
        finished.update({e.seq_id: e for e in events if e.finished})
    assert finished[a.seq_id].token_ids == [2, 9] and finished[a.seq_id].finish_reason == "stop"
    assert finished[b.seq_id].token_ids == [2, 2, 2]
    assert finished[b.seq_id].finish_reason == "length"
    assert not s.has_work() and len(s.free_slots) == 4 and s.cache_rows == 0


def test_events_every_segment_tokens_and_at_the_end():
    s = Scheduler(4, segment=3)
    a = seq(max_new=8)
    s.add(a)
    events = []
    while s.has_work():
        events += fake_step(s, token=lambda q: len(q.tokens))[1]
    assert [e.token_ids for e in events] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [e.finished for e in events] == [False, False, True]
    assert all(e.versions == [7] * len(e.token_ids) for e in events)


def test_abort_and_pause_free_slots_and_resume_goes_first():
    s = Scheduler(2)
    a, b, c, d = seq(), seq(), seq(), seq()
    for q in (a, b, c, d):
        s.add(q)
    fake_step(s)
    assert len(s.free_slots) == 0
    s.abort(a.seq_id)
    paused = s.pause(b.seq_id)
    assert paused.status is SeqStatus.PAUSED and paused.tokens == [1]
    assert len(s.free_slots) == 2 and not s.running
    s.resume(b.seq_id)
    assert b.prefill_ids == b.prompt + [1]  # re-prefill of prompt + partial response
    plan, _ = fake_step(s)
    assert plan.prefill == [b, c]  # the resumed one ahead of the queue
    assert b.cached == 4 and b.tokens == [1, 1]
    with pytest.raises(KeyError, match="not waiting, running or paused"):
        s.abort(a.seq_id)
    with pytest.raises(KeyError, match="not paused"):
        s.resume(c.seq_id)
    check_invariants(s)


def test_fork_copies_the_parent_row_when_slots_are_free_and_queues_otherwise():
    s = Scheduler(3)
    parent = seq(prompt_len=5, max_new=6)
    s.add(parent)
    fake_step(s), fake_step(s)
    kid = Sequence(next(_ids), None, parent.prompt, parent.params, tokens=list(parent.tokens))
    assert s.fork(parent, [kid])
    assert kid.status is SeqStatus.RUNNING and kid.cached == parent.cached == 6
    plan, _ = fake_step(s)
    assert plan.copies == [(parent.slot, kid.slot, 6)] and not plan.prefill
    assert plan.decode == [parent, kid]
    late = [Sequence(next(_ids), None, parent.prompt, parent.params,
                     tokens=list(parent.tokens)) for _ in range(2)]
    assert not s.fork(parent, late)  # one slot left for two children: both wait, first in line
    assert list(s.waiting)[:2] == late and all(k.cached == 0 for k in late)
    check_invariants(s)


def test_identical_prompts_admitted_together_share_one_prefill():
    s = Scheduler(8)
    group = [seq(prompt_len=4, first=0) for _ in range(3)]
    other = seq(prompt_len=4, first=50)
    for q in group + [other]:
        s.add(q)
    plan, _ = fake_step(s)
    assert plan.prefill == [group[0], other]
    assert plan.shared == [(group[1], group[0]), (group[2], group[0])]
    assert plan.after_copies == [(group[0].slot, group[1].slot, 4),
                                 (group[0].slot, group[2].slot, 4)]
    assert plan.num_tokens == 8
    assert all(q.cached == 4 for q in group)


def test_prefill_token_budget_spreads_admissions_over_steps():
    s = Scheduler(8, max_prefill_tokens=10)
    qs = [seq(prompt_len=4, first=10 * i) for i in range(4)]
    for q in qs:
        s.add(q)
    plan, _ = fake_step(s)
    assert plan.prefill == qs[:2]  # 8 tokens; a third would make 12
    plan, _ = fake_step(s)
    assert plan.prefill == qs[2:]


def test_kv_budget_makes_requests_wait_and_is_never_exceeded():
    rng = random.Random(0)
    s = Scheduler(16, kv_budget_tokens=8 * 32)
    for _ in range(40):
        s.add(seq(prompt_len=rng.randint(1, 8), max_new=rng.randint(1, 20)))
    peak = 0
    while s.has_work():
        plan, _ = fake_step(s, token=lambda q: rng.randint(0, 5))
        assert plan.cache_rows * plan.cache_len <= 8 * 32
        peak = max(peak, len(plan.sequences))
        check_invariants(s)
    assert 1 < peak < 16  # the budget, not the slots, bounded the batch


def test_a_request_larger_than_the_budget_is_refused_with_the_fix():
    s = Scheduler(4, kv_budget_tokens=32)
    with pytest.raises(ValueError, match="raise the budget or shorten"):
        s.add(seq(prompt_len=20, max_new=20))


def test_random_workload_keeps_invariants_and_finishes_everything():
    rng = random.Random(1)
    s = Scheduler(5, segment=2)
    live = []
    done = set()
    for step in range(300):
        if rng.random() < 0.3:
            q = seq(prompt_len=rng.randint(1, 6), max_new=rng.randint(1, 9), stop=(0,))
            s.add(q)
            live.append(q)
        active = [q for q in live if q.status in (SeqStatus.RUNNING, SeqStatus.WAITING)]
        if active and rng.random() < 0.05:
            s.abort(rng.choice(active).seq_id)
        if active and rng.random() < 0.05:
            s.pause(rng.choice(active).seq_id)
        if s.paused and rng.random() < 0.2:
            s.resume(next(iter(s.paused)))
        _, events = fake_step(s, token=lambda q: rng.randint(0, 6))
        done |= {e.seq_id for e in events if e.finished}
        check_invariants(s)
    for q in live:
        if q.status is SeqStatus.FINISHED:
            assert q.seq_id in done and q.done_reason() == q.finish_reason


def test_decode_window_ends_at_the_first_event_limit_or_admission():
    s = Scheduler(2, segment=4)
    a, b, late = seq(max_new=3), seq(max_new=10), seq(max_new=2)
    s.add(a), s.add(b)
    plan, _ = fake_step(s)
    assert s.decode_window(plan) == 1  # a prefill step runs alone
    plan = s.schedule()
    assert plan.decode == [a, b] and s.decode_window(plan) == 2  # a hits its limit after 2
    events = s.update_window(plan, [[5, 6], [5, 6]], [[-0.1, -0.2]] * 2, [[1.0, 2.0]] * 2, 3)
    assert [(e.seq_id, e.token_ids, e.finished) for e in events] == [(a.seq_id, [1, 5, 6], True)]
    assert b.tokens == [1, 5, 6] and b.versions == [7, 3, 3] and b.cached == len(b.prompt) + 2
    s.add(late)
    plan = s.schedule()  # late takes a's slot: a prefill, so one pass
    assert plan.prefill == [late] and s.decode_window(plan) == 1
    s.update(plan, StepOutput([1, 1], [0.0] * 2, [0.0] * 2, 3))
    plan = s.schedule()
    assert s.decode_window(plan) == 1  # late is one token from its length limit
    s.add(seq())
    s.update(plan, StepOutput([2, 2], [0.0] * 2, [0.0] * 2, 3))  # late finishes, a slot frees
    plan = s.schedule()
    assert plan.prefill and s.decode_window(plan) == 1


def test_update_window_cuts_a_sequence_at_its_stop_id():
    s = Scheduler(2, segment=8)
    a, b = seq(max_new=8, stop=(9,)), seq(max_new=8, stop=(9,))
    s.add(a), s.add(b)
    fake_step(s)
    plan = s.schedule()
    k = s.decode_window(plan)
    assert k == 7
    toks = [[2, 9, 4, 4, 4, 4, 4], [2] * 7]
    events = s.update_window(plan, toks, [[-1.0] * k] * 2, [[0.5] * k] * 2, 1)
    assert [(e.seq_id, e.token_ids, e.finish_reason) for e in events] == [
        (a.seq_id, [1, 2, 9], "stop"), (b.seq_id, [1] + [2] * 7, "length")]
    assert a.logprobs == [-0.5, -1.0, -1.0] and not s.running and len(s.free_slots) == 2
