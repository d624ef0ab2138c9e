"""Kept pauses (pause(keep=True)): a paused sequence holds its slot and K/V, continues from
them on resume with no prefill (across a weight sync: on the K/V the old weights computed),
is evicted for room by the stated rule, and recompute_in_flight prefills running sequences
again under new weights. References: an uninterrupted run, and HF forward passes that build
the kept K/V with the old weights and continue with the new ones."""

import dataclasses

import engine_contract as contract
import pytest
import torch
from engine_contract import PROMPTS
from transformers import DynamicCache

from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.runner import cache_kwarg
from rollwise.engine.sampling import entropy, sampling_logprobs
from rollwise.engine.scheduler import Scheduler, SeqStatus, Sequence, StepOutput

SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=12)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(params=["off", "eager"], ids=["runner", "graph"])
def make(request):
    def build(model, **kw):
        return BuiltinEngine(model, **({"max_batch": 4, "segment": 4, "graph": request.param}
                                       | kw))
    return build


def test_a_kept_pause_resumes_with_no_prefill_and_the_same_tokens(make):
    model, _ = contract.wild_model(seed=3)
    params = dataclasses.replace(SAMPLE, seed=21)
    straight = make(model).generate([Request(PROMPTS[1], params)])[0]
    engine = make(model)
    sid = engine.add(Request(PROMPTS[1], params))
    contract.run_to_tokens(engine, sid, 4)
    first = engine.pause(sid, keep=True)
    assert first.finish_reason == "paused" and engine.scheduler.is_kept(sid)
    assert not engine.has_unfinished() and not engine.release_idle_memory()  # K/V held
    prefilled = engine.prefill_tokens
    engine.resume(sid)
    rest = contract.collect(contract.drain(engine), sid)
    assert first.token_ids + rest == straight.token_ids  # its random stream continued
    assert engine.prefill_tokens == prefilled  # nothing fed again
    assert engine.kept_metrics()["kept_resumed_tokens"] == len(PROMPTS[1]) + len(
        first.token_ids) - 1  # every position but the latest token's, fed next


@torch.no_grad()
def kept_reference(old, new, prompt, tokens, n, params):
    """Tokens and log-probs of greedy decoding continued by `new` from the K/V `old`
    computed over prompt + tokens[:-1]."""
    cache = {cache_kwarg(old): DynamicCache(), "use_cache": True}
    old(torch.tensor([prompt + tokens[:-1]]), **cache)
    out, lps, ents, last = [], [], [], tokens[-1]
    for _ in range(n):
        logits = new(torch.tensor([[last]]), **cache).logits[0]
        logp = sampling_logprobs(logits.float(), torch.full((1,), params.temperature),
                                 torch.full((1,), params.top_k), torch.full((1,), params.top_p))
        last = int(logits[0].argmax())
        out.append(last)
        lps.append(float(logp[0, last]))
        ents.append(float(entropy(logp)[0]))
    return out, lps, ents


def test_after_a_weight_sync_a_kept_sequence_continues_on_the_old_weights_k_v(make):
    old, _ = contract.wild_model(seed=1)
    new, _ = contract.wild_model(seed=2)
    engine = make(old)
    sid = engine.add(Request(PROMPTS[0], GREEDY))
    contract.run_to_tokens(engine, sid, 4)
    first = engine.pause(sid, keep=True)
    engine.load_weights(new.state_dict(), version=1)
    engine.resume(sid)
    events = contract.drain(engine)
    rest = contract.collect(events, sid)
    lps = [x for e in events for x in e.logprobs]
    versions = [v for e in events for v in e.versions]
    want, want_lp, _ = kept_reference(old, new, PROMPTS[0], first.token_ids, len(rest), GREEDY)
    assert rest == want and set(versions) == {1}
    assert torch.allclose(torch.tensor(lps), torch.tensor(want_lp), atol=1e-5)
    full, _ = contract.forward_logprobs(new, PROMPTS[0], first.token_ids + rest, GREEDY)
    assert not torch.allclose(full[len(first.token_ids):], torch.tensor(lps), atol=1e-3)


def test_recompute_in_flight_prefills_again_under_the_new_weights(make):
    old, _ = contract.wild_model(seed=1)
    new, _ = contract.wild_model(seed=2)
    engine = make(old)
    sid = engine.add(Request(PROMPTS[2], GREEDY))
    head = contract.collect(contract.run_to_tokens(engine, sid, 4), sid)
    engine.load_weights(new.state_dict(), version=1)
    prefilled = engine.prefill_tokens
    dropped = engine.recompute_in_flight()
    events = contract.drain(engine)
    tokens = head + contract.collect(events, sid)
    assert dropped == len(PROMPTS[2]) + len(head) - 1
    assert engine.prefill_tokens - prefilled == len(PROMPTS[2]) + len(head)
    lps = torch.tensor([x for e in events for x in e.logprobs])
    full, _ = contract.forward_logprobs(new, PROMPTS[2], tokens, GREEDY)
    assert torch.allclose(full[len(head):], lps, atol=1e-5)  # a full pass of the new weights
    assert tokens[len(head):] == contract.hf_greedy(new, PROMPTS[2] + head, len(tokens) - len(
        head))


def test_a_request_that_cannot_fit_evicts_the_kept_sequence_holding_fewest_positions(make):
    model, _ = contract.wild_model(seed=5)
    params = dataclasses.replace(SAMPLE, max_new_tokens=20)
    engine = make(model, kv_budget_tokens=64)  # room for two rows of 32 positions
    first_id = engine.add(Request(PROMPTS[0], dataclasses.replace(params, seed=1)))
    second_id = engine.add(Request(PROMPTS[1], dataclasses.replace(params, seed=2)))
    contract.run_to_tokens(engine, first_id, 8)
    paused = {i: engine.pause(i, keep=True) for i in (first_id, second_id)}
    s = engine.scheduler
    assert s.is_kept(first_id) and s.is_kept(second_id)
    big = engine.add(Request(PROMPTS[2], dataclasses.replace(params, seed=3)))
    engine.step()
    prompt = {first_id: PROMPTS[0], second_id: PROMPTS[1]}
    evicted = min(paused, key=lambda i: len(prompt[i]) + len(paused[i].token_ids))
    assert not s.is_kept(evicted) and s.get(evicted).status is SeqStatus.PAUSED
    assert s.evicted_kept == 1 and s.get(big).status is SeqStatus.RUNNING
    contract.drain(engine)
    prefilled = engine.prefill_tokens
    engine.resume(evicted)  # its K/V is gone: prompt + tokens are prefilled again
    rest = contract.collect(contract.drain(engine), evicted)
    done = paused[evicted].token_ids
    assert engine.prefill_tokens - prefilled == len(prompt[evicted]) + len(done)
    assert len(done) + len(rest) == params.max_new_tokens


def test_find_paused_names_the_request_whose_ids_match(make):
    model, _ = contract.wild_model(seed=3)
    engine = make(model)
    sid = engine.add(Request(PROMPTS[3], dataclasses.replace(SAMPLE, seed=4), "u1"))
    contract.run_to_tokens(engine, sid, 4)
    c = engine.pause(sid, keep=True)
    assert engine.find_paused("u1", PROMPTS[3] + c.token_ids) == (sid, len(c.token_ids))
    assert engine.find_paused("u1", PROMPTS[3] + c.token_ids[:-1]) is None
    assert engine.find_paused("u2", PROMPTS[3] + c.token_ids) is None
    engine.abort(sid)
    assert engine.find_paused("u1", PROMPTS[3] + c.token_ids) is None
    assert not engine.scheduler.kept and engine.scheduler.free_slots == [0, 1, 2, 3]


def seq(i, prompt_len=4, max_new=8):
    return Sequence(i, i, list(range(1, prompt_len + 1)),
                    SamplingParams(temperature=0, max_new_tokens=max_new))


def step(s: Scheduler):
    plan = s.schedule()
    n = len(plan.sequences)
    s.update(plan, StepOutput([7] * n, [0.0] * n, [0.0] * n, 0))
    return plan


def test_compaction_moves_kept_sequences_out_of_the_running_rows():
    s = Scheduler(8, segment=4)
    for i in range(3):
        s.add(seq(i))
    step(s)
    s.pause(0, keep=True)  # slot 0 kept, running in slots 1 and 2
    plan = step(s)
    assert sorted(q.slot for q in plan.decode) == [0, 1]  # rows 0..n-1 for the decode
    kept = s.get(0)
    assert kept.slot >= 2 and kept.cached == 4
    assert plan.copies[0] == (0, kept.slot, 4)  # its K/V moved before its row was reused
    s.resume(0)
    plan = step(s)
    assert not plan.prefill and len(plan.decode) == 3
