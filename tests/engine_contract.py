"""The engine contract, as checks any backend must pass (built-in:
tests/engine/test_engine_contract.py; vLLM: tests/with_vllm/test_vllm_contract.py). Every check
compares the engine against the model itself: Hugging Face `generate` for greedy tokens, a full
forward pass over the finished sequence for behaviour log-probabilities and entropies."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from rollwise import models
from rollwise.config import ModelConfig
from rollwise.engine import Request, SamplingParams
from rollwise.engine.sampling import entropy, sampling_logprobs

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21],
           [30, 31, 32, 33]]
SAMPLED = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=12, seed=3)


def wild_model(hidden: int = 32, heads: int = 4, kv_heads: int = 2, arch: str = "qwen2",
               seed: int = 0):
    """A tiny random model with large weights, so greedy and sampled outputs vary token to token
    (default-initialised tiny models repeat one token)."""
    cfg = ModelConfig(arch=arch, hidden_size=hidden, num_layers=2, num_heads=heads,
                      num_kv_heads=kv_heads, intermediate_size=2 * hidden)
    model, tok = models.build(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4, generator=g)
    return model.eval(), tok


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], tokens: list[int], params: SamplingParams
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour log-probabilities and entropies of `tokens` by one full forward pass."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    n = len(tokens)
    logp = sampling_logprobs(logits, torch.full((n,), params.temperature),
                             torch.full((n,), params.top_k), torch.full((n,), params.top_p))
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), entropy(logp)


def max_logprob_error(model, prompt, completion, params) -> float:
    lp, ent = forward_logprobs(model, prompt, completion.token_ids, params)
    return max((lp - torch.tensor(completion.logprobs)).abs().max().item(),
               (ent - torch.tensor(completion.entropies)).abs().max().item())


# ---- the checks -------------------------------------------------------------------------------
def check_greedy_matches_hf(engine, model, n: int = 10) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    got = engine.generate([Request(p, params, i) for i, p in enumerate(PROMPTS)])
    for p, c in zip(PROMPTS, got):
        assert c.token_ids == hf_greedy(model, p, n), f"prompt {p}"
        assert c.finish_reason == "length"


def check_logprobs_match_forward(engine, model, tol: float) -> None:
    """Sampled with temperature, top-k and top-p; the stop id is a token the first run samples,
    so some requests end on it and some on the length limit."""
    params = [dataclasses.replace(SAMPLED, seed=3 + i) for i in range(len(PROMPTS))]
    first = engine.generate([Request(p, q, i) for i, (p, q) in enumerate(zip(PROMPTS, params))])
    counts = Counter(t for c in first for t in c.token_ids[1:-1])
    stop = counts.most_common(1)[0][0]
    params = [dataclasses.replace(q, stop_ids=(stop,)) for q in params]
    got = engine.generate([Request(p, q, i) for i, (p, q) in enumerate(zip(PROMPTS, params))])
    assert [c.request_id for c in got] == list(range(len(PROMPTS)))
    for p, q, c, f in zip(PROMPTS, params, got, first):
        assert c.token_ids == f.token_ids[:len(c.token_ids)]  # same seed: same tokens to the stop
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == stop and stop not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == q.max_new_tokens
            assert stop not in c.token_ids
        assert max_logprob_error(model, p, c, q) < tol
    assert {c.finish_reason for c in got} == {"stop", "length"}


def run_to_tokens(engine, seq_id: int, n: int) -> list:
    """Step until sequence `seq_id` has at least n tokens; returns all events seen."""
    events = []
    while True:
        events += engine.step()
        mine = [t for e in events if e.seq_id == seq_id for t in e.token_ids]
        if len(mine) >= n or any(e.seq_id == seq_id and e.finished for e in events):
            return events


def drain(engine) -> list:
    return [e for e in engine.stream()]


def collect(events, seq_id: int) -> list[int]:
    return [t for e in events if e.seq_id == seq_id for t in e.token_ids]


def check_fork_continues_as_copy(engine, model, tol: float, segment: int) -> None:
    """A child forked at a segment boundary with seed s continues exactly as a fresh request
    with prompt + the parent's tokens and seed s; its log-probs match a full forward pass."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=1.0, max_new_tokens=3 * segment, seed=5)
    parent = engine.add(Request(prompt, params, "root"))
    events = run_to_tokens(engine, parent, segment)
    prefix = collect(events, parent)
    assert len(prefix) == segment
    kids = engine.fork(parent, 2, seeds=[101, 202])
    events += drain(engine)
    done = {e.seq_id: e for e in events if e.finished}
    assert set(done) >= {parent, *kids}
    for kid, seed in zip(kids, (101, 202)):
        own = collect(events, kid)  # events carry the child's own tokens only
        fresh = engine.generate([Request(prompt + prefix, SamplingParams(
            temperature=1.0, max_new_tokens=2 * segment, seed=seed), "copy")])[0]
        assert own == fresh.token_ids
        c = [e for e in events if e.seq_id == kid]
        full = prefix + own
        lp, ent = forward_logprobs(model, prompt, full, params)
        got = torch.tensor([x for e in c for x in e.logprobs])
        assert (lp[segment:] - got).abs().max().item() < tol
    assert collect(events, kids[0]) != collect(events, kids[1]), "children should differ"


def check_pause_resume(engine, model, tol: float) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=9)
    sid = engine.add(Request(PROMPTS[3], params, "p"))
    other = engine.add(Request(PROMPTS[0], params, "o"))
    run_to_tokens(engine, sid, 4)
    partial = engine.pause(sid)
    assert partial.finish_reason == "paused" and 4 <= len(partial.token_ids) < 12
    events = drain(engine)  # the other request finishes while this one is paused
    assert all(e.seq_id == other for e in events)
    engine.resume(sid)
    events = drain(engine)
    rest = collect(events, sid)
    final = [e for e in events if e.seq_id == sid and e.finished][0]
    tokens = partial.token_ids + rest
    assert len(tokens) == 12 and final.finish_reason == "length"
    lp, ent = forward_logprobs(model, PROMPTS[3], tokens, params)
    got = torch.tensor(partial.logprobs + [x for e in events if e.seq_id == sid
                                           for x in e.logprobs])
    assert (lp - got).abs().max().item() < tol


def check_abort(engine) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    a = engine.add(Request(PROMPTS[0], params, "a"))
    b = engine.add(Request(PROMPTS[1], params, "b"))
    run_to_tokens(engine, a, 2)
    got = engine.abort(a)
    assert got.finish_reason == "abort" and len(got.token_ids) >= 2
    events = drain(engine)
    assert {e.seq_id for e in events} == {b}
    assert [e.finish_reason for e in events if e.finished] == ["length"]


def check_segments(engine, segment: int) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=2 * segment + 1, seed=2)
    ids = [engine.add(Request(p, params, i)) for i, p in enumerate(PROMPTS[:3])]
    events = drain(engine)
    for sid in ids:
        mine = [e for e in events if e.seq_id == sid]
        assert [len(e.token_ids) for e in mine] == [segment, segment, 1]
        assert [e.finished for e in mine] == [False, False, True]
        assert all(len(e.logprobs) == len(e.entropies) == len(e.versions) == len(e.token_ids)
                   for e in mine)


def check_top_logprobs(engine, model, tol: float) -> None:
    params = SamplingParams(temperature=0.7, max_new_tokens=5, seed=4, top_logprobs=3)
    c = engine.generate([Request(PROMPTS[2], params, 0)])[0]
    logits = model(torch.tensor([PROMPTS[2] + c.token_ids])).logits[0, len(PROMPTS[2]) - 1:-1]
    logp = (logits.float() / 0.7).log_softmax(-1)
    for row, top in zip(logp, c.top_logprobs):
        vals, idx = row.topk(3)
        assert [t for t, _ in top] == idx.tolist()
        assert max(abs(a - b) for (_, a), b in zip(top, vals.tolist())) < tol


def check_next_turn_reuses_the_prefix(engine, model, block: int) -> None:
    """An agent's next turn (a finished request's ids + new tokens) reuses the K/V the engine
    kept: its first event reports at least the whole blocks of what the engine had run (the
    prompt and the turn but its last token), and the tokens are still the model's."""
    prompt = [(7 * i) % 40 + 3 for i in range(block + 3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    turn = engine.generate([Request(prompt, params)])[0].token_ids
    episode = prompt + turn + [4, 5, 6]
    sid = engine.add(Request(episode, params))
    events = drain(engine)
    seen = len(prompt) + len(turn) - 1
    cached = sum(e.cached_tokens for e in events if e.seq_id == sid)
    assert seen // block * block <= cached <= seen
    assert collect(events, sid) == hf_greedy(model, episode, 8)


def check_load_weights(engine, model, new_state: dict, version: int) -> None:
    """After load_weights, new tokens carry the version and follow the new weights (the
    reference model must already hold `new_state`)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.load_weights(new_state, version)
    assert engine.version == version
    got = engine.generate([Request(p, params, i) for i, p in enumerate(PROMPTS)])
    for p, c in zip(PROMPTS, got):
        assert c.versions == [version] * 8
        assert c.token_ids == hf_greedy(model, p, 8)
