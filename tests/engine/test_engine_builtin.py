"""Built-in engine specifics beyond the shared contract: other architectures, fork without
re-prefill, invisible pause/resume, batch-independent seeds, in-place weights, the KV budget,
shared prompt prefills and hidden states; each on the runner's path and on the decode graph
(uncompiled here: its arithmetic and bookkeeping; compiled in the contract suite)."""

import dataclasses

import engine_contract as contract
import pytest
import torch
from engine_contract import PROMPTS, forward_logprobs, hf_greedy

from rollwise.engine import BuiltinEngine, Request, SamplingParams, SparseUpdate

SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()[0]


@pytest.fixture(params=["off", "eager"], ids=["runner", "graph"])
def make(request):
    def build(model, **kw):
        return BuiltinEngine(model, **({"max_batch": 4, "segment": 4, "graph": request.param}
                                       | kw))
    build.graph = request.param
    return build


@pytest.mark.parametrize("arch,heads,kv_heads", [("llama", 2, 2), ("qwen2", 4, 1)])
def test_greedy_matches_hf_for_other_architectures(arch, heads, kv_heads, make):
    model, _ = contract.wild_model(arch=arch, heads=heads, kv_heads=kv_heads, seed=4)
    got = make(model, max_batch=2).generate(
        [Request(p, SamplingParams(temperature=0, max_new_tokens=8)) for p in PROMPTS])
    assert [c.token_ids for c in got] == [hf_greedy(model, p, 8) for p in PROMPTS]


def test_tokens_do_not_depend_on_batch_mates(wild, make):
    params = [dataclasses.replace(SAMPLE, seed=s) for s in (1, 2, 3)]
    alone = [make(wild).generate([Request(PROMPTS[i], params[i])])[0].token_ids
             for i in range(3)]
    crowd = [Request(p, dataclasses.replace(SAMPLE, seed=50 + i)) for i, p in enumerate(PROMPTS)]
    together = make(wild, max_batch=3).generate(
        crowd[:2] + [Request(PROMPTS[i], params[i]) for i in range(3)] + crowd[2:])
    assert [c.token_ids for c in together[2:5]] == alone


def test_fork_copies_kv_without_prefill_and_branches_on_an_alternative_token(wild, make):
    engine = make(wild)
    sid = engine.add(Request(PROMPTS[3], dataclasses.replace(SAMPLE, seed=8)))
    events = contract.run_to_tokens(engine, sid, 4)
    prefix = contract.collect(events, sid)
    prefilled = engine.prefill_tokens
    alt = (prefix[-1] + 1) % 50
    plain, branched = engine.fork(sid, 1, seeds=[3])[0], engine.fork(sid, 1, last_tokens=[alt])[0]
    events = contract.drain(engine)
    assert engine.prefill_tokens == prefilled  # children reused the parent's K/V rows
    # counted as saved: prompt + the 3 tokens before the latest (its K/V comes next pass)
    assert engine.prefix_tokens_saved == 2 * (len(PROMPTS[3]) + 3)
    finished = {e.seq_id for e in events if e.finished}
    assert finished == {sid, plain, branched}
    with pytest.raises(KeyError, match="not waiting, running or paused"):
        engine.abort(branched)  # finished sequences are gone
    assert len(contract.collect(events, plain)) == SAMPLE.max_new_tokens - 4
    tokens = prefix[:-1] + contract.collect(events, branched)
    assert tokens[3] == alt and len(tokens) == SAMPLE.max_new_tokens
    lp, _ = forward_logprobs(wild, PROMPTS[3], tokens, SAMPLE)
    got = [x for e in events if e.seq_id == branched for x in e.logprobs]
    assert (lp[3:] - torch.tensor(got)).abs().max() < 1e-4  # alt's log p from the parent's row


def test_pause_resume_is_invisible_to_the_tokens(wild, make):
    params = dataclasses.replace(SAMPLE, seed=21, max_new_tokens=12)
    straight = make(wild).generate([Request(PROMPTS[1], params)])[0]
    engine = make(wild)
    sid = engine.add(Request(PROMPTS[1], params))
    contract.run_to_tokens(engine, sid, 4)
    first = engine.pause(sid)
    assert engine.scheduler.free_slots and not engine.scheduler.running
    engine.step()  # idle step: the cache is given back
    assert engine.runner.cache.num_tokens == 0
    engine.resume(sid)
    rest = contract.collect(contract.drain(engine), sid)
    assert first.token_ids + rest == straight.token_ids  # the random stream continued


def test_load_weights_matches_a_fresh_engine_and_stamps_in_flight_tokens(make):
    old, _ = contract.wild_model(seed=1)
    new, _ = contract.wild_model(seed=2)
    engine = make(old)
    params = dataclasses.replace(SAMPLE, seed=4, max_new_tokens=12)
    sid = engine.add(Request(PROMPTS[0], params))
    contract.run_to_tokens(engine, sid, 4)
    engine.load_weights(new.state_dict(), version=1)
    events = contract.drain(engine)
    versions = [v for e in events for v in e.versions]
    assert set(versions) == {1} and len(versions) == 8  # tokens after the load carry v1
    reqs = [Request(p, dataclasses.replace(params, seed=i)) for i, p in enumerate(PROMPTS)]
    got = engine.generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in make(new).generate(reqs)]


def test_sparse_update_equals_full_update_and_bad_input_is_named(make):
    base, _ = contract.wild_model(seed=1)
    target, _ = contract.wild_model(seed=2)
    full, sparse = make(base), make(base)
    full.load_weights(target.state_dict(), 1)
    updates = {}
    for name, t in target.state_dict().items():
        old = base.state_dict()[name].flatten()
        idx = (t.flatten() != old).nonzero().squeeze(1)
        updates[name] = SparseUpdate(idx, t.flatten()[idx])
    sparse.load_weights(updates, 1)
    for name, t in full.model.state_dict().items():
        assert torch.equal(t, sparse.model.state_dict()[name])
    with pytest.raises(KeyError, match="not in the engine's model"):
        sparse.load_weights({"nope.weight": torch.zeros(1)}, 2)
    with pytest.raises(ValueError, match="has shape"):
        sparse.load_weights({"model.norm.weight": torch.zeros(3)}, 2)
    with pytest.raises(ValueError, match="past its"):
        sparse.load_weights({"model.norm.weight": (torch.tensor([10**6]), torch.ones(1))}, 2)


def test_in_place_writes_to_the_model_state_dict_are_live(wild, make):
    """Weight sync may write engine.model.state_dict() tensors directly."""
    engine = make(wild)
    new, _ = contract.wild_model(seed=7)
    with torch.no_grad():
        for name, t in engine.model.state_dict().items():
            t.copy_(new.state_dict()[name])
    got = engine.generate([Request(p, SamplingParams(temperature=0, max_new_tokens=6))
                           for p in PROMPTS])
    assert [c.token_ids for c in got] == [hf_greedy(new, p, 6) for p in PROMPTS]


def test_kv_budget_bounds_the_cache_and_leaves_results_unchanged(wild, make):
    reqs = [Request(p, dataclasses.replace(SAMPLE, seed=i, max_new_tokens=4 + 3 * i))
            for i, p in enumerate(PROMPTS)]
    free = make(wild, max_batch=6).generate(reqs)
    engine = make(wild, max_batch=6, kv_budget_tokens=64)
    for r in reqs:
        engine.add(r)
    events = []
    while engine.has_unfinished():
        events += engine.step()
        assert 0 <= engine.runner.cache.num_tokens <= 64
        assert len(engine.scheduler.running) < 6  # the budget, not the slots, bounds the batch
    assert sum(e.finished for e in events) == len(reqs)  # everyone waited their turn and ran
    budgeted = make(wild, max_batch=6, kv_budget_tokens=64).generate(reqs)
    assert [c.token_ids for c in budgeted] == [c.token_ids for c in free]


def test_long_tail_with_slot_moves_and_cache_shrinks_equals_each_request_alone(wild, make):
    """When the short requests end, the long ones in the top slots move down (K/V row copies)
    while the cache shrinks (24 rows to 8) in the same step; a second batch reuses the engine.
    None of it may change a token."""
    lengths = [1, 2] * 10 + [20] * 4
    reqs = [Request(PROMPTS[i % 6][: 1 + i % 4] + [i + 3],
                    dataclasses.replace(SAMPLE, seed=i, max_new_tokens=n))
            for i, n in enumerate(lengths)]
    reqs += [dataclasses.replace(r, prompt_ids=[9] + r.prompt_ids) for r in reqs]
    engine = make(wild, max_batch=24)
    got = engine.generate(reqs[:24]) + engine.generate(reqs[24:])
    assert [len(c.token_ids) for c in got] == lengths * 2
    alone = make(wild, max_batch=1)
    assert [c.token_ids for c in got] == [alone.generate([r])[0].token_ids for r in reqs]


def test_a_group_shares_one_prompt_prefill_and_matches_separate_runs(wild, make):
    params = [dataclasses.replace(SAMPLE, seed=s) for s in range(8)]
    engine = make(wild, max_batch=8)
    group = engine.generate([Request(PROMPTS[3], p) for p in params])
    assert engine.prefill_tokens == len(PROMPTS[3])
    alone = [make(wild).generate([Request(PROMPTS[3], p)])[0].token_ids for p in params]
    assert [c.token_ids for c in group] == alone
    assert len({tuple(t) for t in alone}) > 1


def test_hidden_state_is_the_lm_head_input_of_the_last_token(wild, make):
    params = dataclasses.replace(SAMPLE, seed=2, max_new_tokens=5, return_hidden=True)
    c = make(wild).generate([Request(PROMPTS[1], params)])[0]
    with torch.no_grad():
        out = wild.model(torch.tensor([PROMPTS[1] + c.token_ids[:-1]]))
    assert c.hidden.shape == (wild.config.hidden_size,)
    assert (out.last_hidden_state[0, -1] - c.hidden).abs().max() < 1e-4


def test_shared_model_keeps_its_attention_and_mode(wild, make):
    impl = wild.config._attn_implementation
    wild.train()
    try:
        hidden = dataclasses.replace(SAMPLE, return_hidden=True)
        got = make(wild, copy_model=False).generate([Request(PROMPTS[0], hidden)])
        assert got[0].hidden is not None
        assert wild.config._attn_implementation == impl and wild.training
        assert not wild.get_output_embeddings()._forward_pre_hooks  # nothing left behind
    finally:
        wild.eval()


def test_bad_requests_are_refused_with_the_fix(wild, make):
    engine = make(wild)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(Request([], SAMPLE))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add(Request([10**6], SAMPLE))
    engine.add(Request(PROMPTS[0], SAMPLE))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([Request(PROMPTS[0], SAMPLE)])
    with pytest.raises(ValueError, match="one per child"):
        engine.fork(0, 2, seeds=[1])


def test_decode_windows_match_one_pass_per_step(wild, make):
    """Passes run back to back inside one step() (nobody to admit, no event due) give the same
    tokens, log-probabilities and events as one pass per step() (top_logprobs forces that on
    the runner's path), including sequences that end on a stop id inside a window."""
    if make.graph != "off":
        pytest.skip("the decode graph runs windows with top_logprobs too: "
                    "test_decode_graph.py compares its windows with the runner's steps")
    params = [dataclasses.replace(SAMPLE, seed=s, max_new_tokens=6 + 3 * s) for s in range(6)]
    first = make(wild).generate([Request(p, q) for p, q in zip(PROMPTS, params)])
    stop = max(range(50), key=lambda t: sum(c.token_ids[1:].count(t) for c in first))
    runs, passes = {}, {}
    for name, top in (("windows", 0), ("single", 1)):
        engine = make(wild, max_batch=6, segment=5)
        ids = [engine.add(Request(p, dataclasses.replace(q, stop_ids=(stop,), top_logprobs=top)))
               for p, q in zip(PROMPTS, params)]
        steps, events = 0, []
        while engine.has_unfinished():
            events += engine.step()
            steps += 1
        runs[name] = steps, [[(e.token_ids, e.logprobs, e.entropies, e.finish_reason)
                              for e in events if e.seq_id == i] for i in ids]
        passes[name] = engine.forward_passes
    assert runs["windows"][1] == runs["single"][1]
    assert runs["windows"][0] < runs["single"][0]  # several passes per step() call
    # forward_passes counts model passes, not step() calls: the same either way
    assert passes["windows"] == passes["single"] == runs["single"][0]
    reasons = {evs[-1][3] for evs in runs["windows"][1]}
    assert reasons == {"stop", "length"}


def test_batched_kv_copies_equal_one_by_one_copies():
    """SlotCache.copy_many batches copies but must equal applying them in order, chains
    (a row copied on after it was written in the same list) included."""
    from rollwise.engine.runner import SlotCache
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        a, b = SlotCache(), SlotCache()
        for c in (a, b):
            c.rows, c.length = 6, 8
        for layer in range(2):
            k, v = torch.randn(6, 2, 8, 4, generator=gen), torch.randn(6, 2, 8, 4, generator=gen)
            a.k[layer], a.v[layer], b.k[layer], b.v[layer] = k, v, k.clone(), v.clone()
        copies = [tuple(int(x) for x in torch.randint(0, 6, (2,), generator=gen)) + (8,)
                  for _ in range(4)]
        copies = [c for c in copies if c[0] != c[1]]
        a.copy_many(copies)
        for src, dst, n in copies:
            for store in (b.k, b.v):
                for t in store.values():
                    t[dst, :, :n] = t[src, :, :n]
        assert all(torch.equal(a.k[i], b.k[i]) and torch.equal(a.v[i], b.v[i]) for i in a.k)
