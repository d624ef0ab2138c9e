"""The built-in engine's prefix cache (rollwise/engine/prefix.py, engine.prefix_cache_tokens): a
request that starts with a finished one's ids reuses its K/V and prefills only the rest, with the
tokens and log-probabilities of a full prefill (Hugging Face `generate`, a full forward pass, an
engine without the cache); new weights empty it; the index keeps to its budget; an agent's next
turn prefills only the environment's tokens. Each engine check runs on the runner's path and
on the decode graph."""

import dataclasses

import engine_contract as contract
import pytest
from engine_contract import forward_logprobs, hf_greedy

from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.prefix import BLOCK, PrefixIndex

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
PROMPT = list(range(3, 23))  # 20 tokens: more than one block


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()[0]


@pytest.fixture(params=["off", "eager"], ids=["runner", "graph"])
def make(request):
    def build(model, cache=4096, **kw):
        defaults = {"max_batch": 8, "segment": 4, "prefix_cache_tokens": cache,
                    "graph": request.param}
        return BuiltinEngine(model, **(defaults | kw))
    return build


def run(engine, requests):
    """Completions and each request's cached_tokens (from its events)."""
    ids = [engine.add(r) for r in requests]
    out = {i: [] for i in ids}
    cached = dict.fromkeys(ids, 0)
    for ev in engine.stream():
        out[ev.seq_id] += ev.token_ids
        cached[ev.seq_id] += ev.cached_tokens
    return [out[i] for i in ids], [cached[i] for i in ids]


def test_a_next_turn_reuses_the_finished_turns_kv_and_matches_a_full_prefill(wild, make):
    engine = make(wild)
    (turn,), _ = run(engine, [Request(PROMPT, GREEDY)])
    episode = PROMPT + turn + [40, 41, 42, 43, 44]  # + the environment's tokens
    before = engine.prefill_tokens
    (nxt,), (cached,) = run(engine, [Request(episode, GREEDY)])
    # every token the engine had fed is reused: the prompt and the turn but its last token
    assert cached == len(PROMPT) + len(turn) - 1 == engine.prefix_hit_tokens
    assert engine.prefill_tokens - before == len(episode) - cached
    assert nxt == hf_greedy(wild, episode, GREEDY.max_new_tokens)
    sampled = dataclasses.replace(GREEDY, temperature=0.9, seed=5)
    with_cache, plain = make(wild), make(wild, cache=0)
    for e in (with_cache, plain):
        run(e, [Request(PROMPT, GREEDY)])
    a = with_cache.generate([Request(episode, sampled)])[0]
    b = plain.generate([Request(episode, sampled)])[0]
    assert with_cache.prefix_hit_tokens == cached and plain.prefix_hit_tokens == 0
    assert a.token_ids == b.token_ids
    lp, ent = forward_logprobs(wild, episode, a.token_ids, sampled)
    assert max(abs(x - y) for x, y in zip(a.logprobs, lp.tolist())) < 1e-4
    assert max(abs(x - y) for x, y in zip(a.entropies, ent.tolist())) < 1e-4


def test_the_contracts_next_turn_check(wild, make):
    contract.check_next_turn_reuses_the_prefix(make(wild), wild, BLOCK)


def test_extensions_share_passes_with_fresh_prefills_and_decodes(wild, make):
    """Requests extending kept prefixes by different lengths, admitted beside fresh requests
    and running ones, in one engine: each gets what it gets alone with no cache."""
    engine = make(wild, max_batch=5)
    firsts, _ = run(engine, [Request(PROMPT, GREEDY), Request(PROMPT[::-1] + [7, 8], GREEDY)])
    roots = [PROMPT + firsts[0], PROMPT[::-1] + [7, 8] + firsts[1]]
    requests = [Request(roots[0] + [30], GREEDY), Request([5, 6, 7], GREEDY),
                Request(roots[1] + [31, 32, 33, 34, 35, 36], GREEDY),
                Request(roots[0][:BLOCK + 3], GREEDY),  # a prefix of a kept sequence
                Request(list(range(30, 50)), GREEDY), Request(roots[1] + [9] * 12, GREEDY)]
    got, cached = run(engine, requests)
    alone = [make(wild, cache=0).generate([r])[0].token_ids for r in requests]
    assert got == alone
    # the sixth waits for a slot; by then the third has finished and left roots[1] whole
    assert cached == [len(roots[0]) - 1, 0, len(roots[1]) - 1, BLOCK + 2, 0, len(roots[1])]


def test_requests_sharing_a_prefill_share_its_reuse(wild, make):
    """Two samples of one next turn (same ids): one prefill after the loaded K/V, copied to
    the other; both report the reused positions."""
    engine = make(wild)
    (turn,), _ = run(engine, [Request(PROMPT, GREEDY)])
    episode = PROMPT + turn + [40, 41]
    before = engine.prefill_tokens
    sampled = [dataclasses.replace(GREEDY, temperature=1.0, seed=s) for s in (1, 2)]
    got, cached = run(engine, [Request(episode, p) for p in sampled])
    assert cached == [len(PROMPT) + len(turn) - 1] * 2
    assert engine.prefill_tokens - before == len(episode) - cached[0]
    assert got == [make(wild, cache=0).generate([Request(episode, p)])[0].token_ids
                   for p in sampled]


def test_new_weights_empty_the_prefix_cache(wild, make):
    other = contract.wild_model(seed=7)[0]
    engine = make(wild)
    (turn,), _ = run(engine, [Request(PROMPT, GREEDY)])
    engine.load_weights(other.state_dict(), version=1)
    episode = PROMPT + turn + [40]
    (nxt,), (cached,) = run(engine, [Request(episode, GREEDY)])
    assert cached == 0 and nxt == hf_greedy(other, episode, GREEDY.max_new_tokens)
    engine.load_weights(wild.state_dict(), version=2)  # the engine's own model again
    run(engine, [Request(PROMPT, GREEDY)])
    engine.reset_prefix_cache()
    assert run(engine, [Request(episode, GREEDY)])[1] == [0]


def test_the_index_finds_the_longest_kept_prefix_and_keeps_to_its_budget():
    index = PrefixIndex(budget=100)
    a, _ = index.insert(list(range(40)))
    b, _ = index.insert(list(range(30)) + [99] * 10)
    assert index.lookup(list(range(50))) == (a, 40)
    assert index.lookup(list(range(30)) + [99] * 12) == (b, 40)
    assert index.lookup(list(range(25)) + [7] * 5)[1] == 25  # either entry shares 25
    assert index.lookup(list(range(40))) == (a, 39)  # the last token is always fed
    assert index.lookup(list(range(BLOCK - 1)) + [5, 5]) is None  # less than a block shared
    assert index.lookup([1] + list(range(1, 40))) is None  # differs in the first block
    assert index.insert(list(range(101)))[0] is None  # larger than the whole budget
    index.lookup(list(range(50)))  # a was used last: b is the oldest
    c, dropped = index.insert(list(range(200, 240)))
    assert dropped == [b] and index.size == 80 and set(index.entries) == {a, c}
    assert index.clear() == [a, c] and index.lookup(list(range(50))) is None
    with pytest.raises(ValueError, match="at least 16"):
        PrefixIndex(budget=8)


@pytest.mark.parametrize("earlier", [0, 7, 30])
def test_ties_go_to_the_oldest_entry_whatever_came_before(earlier):
    """Entries with the same ids hold K/V from different passes (equal to the last bits
    only), so which one a lookup reuses must not depend on the entry ids an earlier round used
    up: an evaluation between two training rounds once changed the second round's numbers."""
    index = PrefixIndex(budget=1000)
    for _ in range(earlier):  # an earlier round's entries, forgotten at the reset
        index.insert(list(range(20)))
    index.clear()
    first, _ = index.insert(list(range(32)))
    index.insert(list(range(32)))  # a sibling's equal prefix, entered later
    assert index.lookup(list(range(40)))[0] == first


def test_an_entry_loaded_and_extended_is_replaced_and_lru_eviction_frees_its_kv(wild, make):
    engine = make(wild, cache=64)
    (turn,), _ = run(engine, [Request(PROMPT, GREEDY)])
    first = next(iter(engine.scheduler.prefix.entries))
    (turn2,), _ = run(engine, [Request(PROMPT + turn + [40], GREEDY)])
    entries = engine.scheduler.prefix.entries
    assert first not in entries and first not in engine.runner.prefixes  # superseded
    (kept,) = entries.values()
    assert kept == (PROMPT + turn + [40] + turn2)[:len(kept)]
    run(engine, [Request(list(range(21, 51)), GREEDY)])  # 39 more: over the budget of 64
    assert set(engine.runner.prefixes) == set(entries) and engine.scheduler.prefix.size <= 64


def play(model, cache: int, make):
    from rollwise.agents.episode import EpisodeGenerator
    from rollwise.config import load_config
    from rollwise.models import char_tokenizer
    from rollwise.stages.control.inflight import RunToEnd
    from rollwise.stages.generate.rollout import Rollout
    from rollwise.stages.ledger import Ledger
    from rollwise.tasks import Problem
    tok = char_tokenizer()
    cfg = load_config(None, ["generate.strategy=episode",
                             "generate.env=rollwise.bench.agent_kv:Echo",  # always answers
                             "generate.group_size=3", "generate.max_new_tokens=6",
                             "generate.max_turns=4"])
    text = "what is twelve times seven ="
    problems = [Problem("p0", text, "84"), Problem("p1", text[::-1], "84")]
    for p in problems:
        p.prompt_ids = tok.encode(p.prompt, add_special_tokens=False)
    engine = make(model, cache=cache, max_batch=4, segment=2)
    rollout = Rollout(engine, RunToEnd(), Ledger(),
                      SamplingParams(temperature=1.0, max_new_tokens=6,
                                     stop_ids=tuple(range(0, 52, 3))))
    EpisodeGenerator(cfg, tok, seed=3).generate(rollout, problems, step=1)
    return [s for g in rollout.groups for s in g.samples], rollout.ledger.decisions, engine


def test_an_agents_next_turn_prefills_only_the_environments_tokens(wild, make):
    cached, counts, engine = play(wild, cache=2048, make=make)
    plain, plain_counts, plain_engine = play(wild, cache=0, make=make)
    assert [s.response_ids for s in cached] == [s.response_ids for s in plain]
    for a, b in zip(cached, plain):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    seen = plain_counts["agent/reprefill/tokens"]
    assert seen > 0
    assert counts["agent/turn/model"] > 6  # some of the 6 episodes went past their first turn
    assert counts["agent/reprefill/tokens"] == 0 and counts["agent/prefill/reused"] == seen
    assert plain_counts["agent/prefill/reused"] == 0
    # every request's reuse is reported (first turns too: a waiting sample's prompt is its
    # finished sibling's; requests with the same ids admitted together load once and report
    # it each); the engine prefilled exactly the positions it loaded fewer
    assert counts["engine/prefix_cache/tokens"] >= seen
    assert counts["engine/prefix_cache/tokens"] >= engine.prefix_hit_tokens > 0
    assert plain_engine.prefill_tokens - engine.prefill_tokens == engine.prefix_hit_tokens


# ---- shared prefixes of running requests (engine.share_prefix) ------------------------------

PARTIALS = [[30, 31, 32], [40] * 9, [45, 46], [50] * 20]  # differ at their first token


def test_resumed_answers_share_their_prompts_prefill_and_match_a_full_prefill(wild, make):
    """APRIL's case: a group's paused answers resume as prompt + partial answer. The first
    prefills all of it; the others wait one pass, copy the prompt's K/V from its slot and
    prefill only their own tokens, with the tokens and log-probabilities of a full prefill."""
    sampled = [dataclasses.replace(GREEDY, temperature=1.0, seed=s) for s in range(4)]
    requests = [Request(PROMPT + p, s) for p, s in zip(PARTIALS, sampled)]
    engine = make(wild, cache=0, share_prefix=True)
    got, cached = run(engine, requests)
    assert engine.prefill_tokens == len(PROMPT) + sum(map(len, PARTIALS))
    assert engine.scheduler.shared_prefix_tokens == 3 * len(PROMPT)
    assert engine.prefix_tokens_saved == 3 * len(PROMPT) and cached == [0] * 4
    plain = make(wild, cache=0)
    assert got == [c.token_ids for c in plain.generate(requests)]
    assert plain.prefill_tokens == sum(len(r.prompt_ids) for r in requests)
    for r, toks, s in zip(requests, got, engine.generate(requests)):
        lp, _ = forward_logprobs(wild, r.prompt_ids, toks, r.params)
        assert s.token_ids == toks
        assert max(abs(x - y) for x, y in zip(s.logprobs, lp.tolist())) < 1e-4


def test_only_kv_of_the_current_weights_is_shared(wild, make):
    """A request running when the weights change holds K/V of the old ones: a later request
    with its prefix prefills it again."""
    other = contract.wild_model(seed=7)[0]
    engine = make(wild, cache=0, share_prefix=True)
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    engine.add(Request(PROMPT, long))
    for _ in range(3):
        engine.step()
    engine.load_weights(other.state_dict(), version=1)
    engine.add(Request(PROMPT + [30, 31], GREEDY))
    out = {}
    for ev in engine.stream():
        out.setdefault(ev.seq_id, []).extend(ev.token_ids)
    assert engine.scheduler.shared_prefix_tokens == 0
    assert out[1] == hf_greedy(other, PROMPT + [30, 31], GREEDY.max_new_tokens)


def test_live_prefixes_find_the_longest_running_donor_or_say_wait():
    from rollwise.engine.prefix import LivePrefixes
    from rollwise.engine.scheduler import Sequence

    def seq(i, ids, cached):
        s = Sequence(i, i, ids, GREEDY)
        s.cached = cached
        return s

    live = LivePrefixes()
    a, b = seq(0, list(range(40)), 40), seq(1, list(range(30)) + [99] * 10, 40)
    live.register(a), live.register(b)
    assert live.find(list(range(50)), pending=set()) == (a, 40)
    assert live.find(list(range(30)) + [99] * 12, pending=set()) == (b, 40)
    assert live.find(list(range(25)) + [7] * 5, pending=set()) == (a, 25)  # a tie: the oldest
    assert live.find(list(range(40)), pending=set()) == (a, 39)  # the last token is fed
    assert live.find(list(range(BLOCK - 1)) + [5, 5], pending=set()) is None
    assert live.find(list(range(50)), pending={0}) == "wait"  # a's K/V not computed yet
    assert live.find(list(range(25)) + [7] * 5, pending={0}) == (b, 25)
    assert live.find(list(range(20)), pending=set()) == (a, 19)
    live.release(0)
    assert live.find(list(range(50)), pending=set()) == (b, 30)
    live.clear()
    assert live.find(list(range(50)), pending=set()) is None
