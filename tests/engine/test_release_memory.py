"""The built-in engine gives back its K/V cache between steps (release_idle_memory) and the
synchronous loop asks it to before each update (run.trim_memory): what it frees, when it must
refuse, and that generation after it is what a fresh engine generates."""

import dataclasses

import engine_contract as contract
import pytest
from engine_contract import PROMPTS

from rollwise.engine import BuiltinEngine, Request, SamplingParams

SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=10)


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()[0]


def requests(seed: int = 0) -> list[Request]:
    return [Request(p, dataclasses.replace(SAMPLED, seed=seed + i)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("graph", ["off", "eager"])
def test_an_idle_engine_frees_its_cache_and_generates_as_before(wild, graph):
    eng = BuiltinEngine(wild, max_batch=4, segment=5, graph=graph)
    first = eng.generate(requests())
    assert eng.runner.cache.num_tokens > 0
    assert eng.release_idle_memory()
    assert eng.runner.cache.num_tokens == 0 and not eng.runner.cache.k
    assert not eng.release_idle_memory()  # nothing left to free
    again = eng.generate(requests(seed=100))
    fresh = BuiltinEngine(wild, max_batch=4, segment=5, graph=graph)
    fresh.generate(requests())
    assert [c.token_ids for c in again] == [c.token_ids for c in fresh.generate(requests(100))]
    assert [c.token_ids for c in first] == [c.token_ids for c in
                                            BuiltinEngine(wild, max_batch=4, segment=5,
                                                          graph=graph).generate(requests())]


def test_a_kept_or_waiting_sequence_keeps_the_cache_a_plainly_paused_one_does_not(wild):
    """A sequence paused with keep=True continues from its K/V: nothing is freed under it. One
    paused without it holds no K/V (its resume prefills again), so the cache may go; both
    continue with the tokens of an uninterrupted run."""
    params = dataclasses.replace(SAMPLED, seed=3, max_new_tokens=12)
    want = BuiltinEngine(wild, max_batch=4, segment=5).generate([Request(PROMPTS[1], params)])
    for keep in (True, False):
        eng = BuiltinEngine(wild, max_batch=4, segment=5)
        sid = eng.add(Request(PROMPTS[1], params))
        events = contract.run_to_tokens(eng, sid, 4)
        eng.pause(sid, keep=keep)
        assert eng.release_idle_memory() is not keep
        assert (eng.runner.cache.num_tokens > 0) is keep
        eng.resume(sid)
        events += contract.drain(eng)
        assert contract.collect(events, sid) == want[0].token_ids
    waiting = BuiltinEngine(wild, max_batch=4, segment=5)
    waiting.generate(requests())
    waiting.add(Request(PROMPTS[0], SAMPLED))
    assert not waiting.release_idle_memory()
