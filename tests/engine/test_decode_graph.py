"""The decode graph (rollwise/engine/decode_graph.py, graph_model.py) and its sampler: the graph
forward against the Hugging Face forward, the on-device sampler and uniform streams against the
host's, the fast path against the runner's token for token, and what must survive it (weights
written in place, packed bf16 weights, padded batches, hidden states, top log-probabilities)."""

import dataclasses
import math

import engine_contract as contract
import pytest
import torch
from engine_contract import PROMPTS, forward_logprobs

from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.graph_model import GraphModel, build_prefill, unsupported
from rollwise.engine.sampling import (
    CDF_BLOCK,
    draw,
    entropy,
    sample_in_graph,
    sampling_logprobs,
    stream_uniform,
    stream_uniforms,
)

SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=14)
SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0), (0.9, 7, 0.6)]


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()[0]


def engine(model, graph="compile", **kw):
    return BuiltinEngine(model, **({"max_batch": 4, "segment": 5, "graph": graph} | kw))


# ---- the uniform streams --------------------------------------------------------------------
def test_uniform_streams_are_the_same_numbers_on_host_and_device():
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(0, 2**62, (200,), generator=g),
                       torch.tensor([0, 1, 2**63 - 1, 2**32, 2**32 - 1])])
    counts = torch.randint(0, 2**31, (205,), generator=g)
    device = stream_uniforms(seeds, counts).tolist()
    host = [stream_uniform(int(s), int(c)) for s, c in zip(seeds, counts)]
    assert device == host
    assert all(0 <= u < 1 for u in host)


def test_uniform_streams_are_uniform_and_independent():
    n = 20000
    counts = torch.arange(n)
    u = stream_uniforms(torch.full((n,), 12345), counts).double()
    ks = (u.sort().values - (torch.arange(n) + 0.5) / n).abs().max().item()
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1 % level
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.03  # next draw
    other = stream_uniforms(torch.full((n,), 12346), counts).double()  # next seed
    assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 0.03


# ---- the sampler ----------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [40, 2 * CDF_BLOCK, 1000])
@pytest.mark.parametrize("setting", SETTINGS)
def test_graph_sampler_matches_the_reference(vocab, setting):
    """Tokens, log-probabilities and entropies of sample_in_graph against sampling_logprobs +
    draw + entropy, with masked logits (-inf) on some rows and bf16 logits."""
    temperature, top_k, top_p = setting
    g = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(48, vocab, generator=g) * 3).to(dtype)
        logits[::4, vocab // 2:] = float("-inf")
        t, k, p = (torch.full((48,), x) for x in setting)
        u = stream_uniforms(torch.arange(48), torch.full((48,), 7))
        logp = sampling_logprobs(logits.float(), t, k, p)
        want = draw(logp, u.double(), t == 0)
        tokens, token_logp, ent = sample_in_graph(logits, t, k, p, u, top_k > 0 or top_p < 1,
                                                  temperature == 0)
        assert torch.equal(tokens, want)
        assert torch.allclose(token_logp, logp.gather(-1, want[:, None])[:, 0], atol=1e-5)
        assert torch.allclose(ent, entropy(logp), atol=1e-4)


def test_graph_sampler_never_leaves_the_support():
    """A uniform at the top of [0, 1) and a vocabulary whose last block has no mass: rounding
    at the top of the CDF must still land on a token with probability > 0."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 3 * CDF_BLOCK, generator=g) * 20
    logits[:, 2 * CDF_BLOCK + 5:] = float("-inf")
    top = torch.full((16,), 1 - 2.0 ** -24)
    tokens, token_logp, _ = sample_in_graph(logits, torch.ones(16), torch.zeros(16).long(),
                                            torch.ones(16), top, False, False)
    assert torch.isfinite(token_logp).all()
    assert (tokens < 2 * CDF_BLOCK + 5).all()


# ---- the graph forward ----------------------------------------------------------------------
def test_prefill_layout_against_a_naive_loop():
    parts = [(3, 0, 4), (0, 7, 2), (5, 2, 5)]
    pre = build_prefill(parts, "cpu")
    rows = [(slot, start + i) for slot, start, n in parts for i in range(n)]
    assert pre.row_slots.tolist() == [r[0] for r in rows]
    assert pre.row_positions.tolist() == [r[1] for r in rows]
    assert pre.slots.tolist() == [3, 0, 5] and pre.keys.tolist() == list(range(9))
    first = 0
    for i, (_, start, n) in enumerate(parts):  # each prefill's padded rows and positions
        assert pre.index[i, :n].tolist() == list(range(first, first + n))
        assert pre.positions[i].tolist() == list(range(start, start + 5))
        first += n
    assert pre.index.view(-1)[pre.take].tolist() == list(range(11))  # the real rows, in order


def qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=48,
                      max_position_embeddings=128, attention_bias=True)
    return Qwen3ForCausalLM(cfg).eval()


def gemma(seed=0):
    from transformers import GemmaConfig, GemmaForCausalLM
    torch.manual_seed(seed)
    cfg = GemmaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      max_position_embeddings=128)
    return GemmaForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [lambda: contract.wild_model(arch="llama")[0],
                                   lambda: contract.wild_model(heads=4, kv_heads=1)[0], qwen3],
                         ids=["llama", "qwen2-gqa", "qwen3-qknorm-bias"])
def test_graph_forward_reproduces_the_model(build):
    model = build()
    assert unsupported(model) is None
    assert GraphModel(model, compile=False).check() < 1e-5  # float32 rounding


def test_a_model_with_other_arithmetic_keeps_the_runners_path():
    """Gemma has the Llama layout but scales its embeddings and norms differently: the check
    catches it, graph='auto' keeps the runner's path (saying why), an explicit mode refuses."""
    model = gemma()
    assert unsupported(model) is None and GraphModel(model, compile=False).check() > 1e-2
    auto = engine(model, graph="auto")
    params = SamplingParams(temperature=0, max_new_tokens=5)
    got = auto.generate([Request(p, params) for p in PROMPTS])
    assert auto.graph is None and "differ" in auto.graph_note
    assert [c.token_ids for c in got] == [contract.hf_greedy(model, p, 5) for p in PROMPTS]
    with pytest.raises(ValueError, match="graph='off'"):
        engine(model, graph="eager").generate([Request(PROMPTS[0], params)])


# ---- the fast path against the runner's ----------------------------------------------------
def run_events(eng, requests):
    ids = [eng.add(r) for r in requests]
    events = [e for e in eng.stream()]
    return [[(e.token_ids, e.finished, e.finish_reason) for e in events if e.seq_id == i]
            for i in ids], [[x for e in events if e.seq_id == i for x in e.logprobs] for i in ids]


@pytest.mark.parametrize("graph", ["eager", "compile"])
def test_the_fast_path_samples_what_the_runner_samples(wild, graph):
    """Same seeds, same events (tokens, where they split, stops inside windows), log-probs
    within float32 rounding, through continuous batching (6 requests, 4 slots)."""
    params = [dataclasses.replace(SAMPLED, seed=s, max_new_tokens=6 + 2 * s) for s in range(6)]
    first = engine(wild, graph="off").generate([Request(p, q) for p, q in zip(PROMPTS, params)])
    stop = max(range(50), key=lambda t: sum(c.token_ids[1:].count(t) for c in first))
    reqs = [Request(p, dataclasses.replace(q, stop_ids=(stop,))) for p, q in zip(PROMPTS, params)]
    want, want_lp = run_events(engine(wild, graph="off"), reqs)
    got, got_lp = run_events(engine(wild, graph=graph), reqs)
    assert got == want
    assert {evs[-1][2] for evs in got} == {"stop", "length"}
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-5


def test_same_seed_same_samples_twice(wild):
    reqs = [Request(p, dataclasses.replace(SAMPLED, seed=40 + i)) for i, p in enumerate(PROMPTS)]
    a = engine(wild).generate(reqs)
    b = engine(wild).generate(reqs)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]


def scaled_model(std: float, dtype=torch.float32):
    """A wild model with weights of this spread: logits of a real model's size (a few units),
    whose float rounding is what the tolerances are about. The wild model's shape, so the
    graphs compiled for it serve (compiling is most of these tests' time)."""
    model = contract.wild_model()[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std, generator=g)
    return model.to(dtype)


def logprob_errors(model, graph: str, params: list[SamplingParams]) -> torch.Tensor:
    got = engine(model, graph=graph).generate([Request(p, q) for p, q in zip(PROMPTS, params)])
    return torch.cat([(forward_logprobs(model, p, c.token_ids, q)[0] -
                       torch.tensor(c.logprobs)).abs() for p, q, c in zip(PROMPTS, params, got)])


def test_behaviour_logprobs_match_a_full_forward_pass_in_float32():
    params = [dataclasses.replace(SAMPLED, seed=s, top_k=9, top_p=0.9) for s in range(6)]
    assert logprob_errors(scaled_model(0.15), "compile", params).max() < 1e-5


@pytest.mark.integration  # compiles the bf16 graph: about 30 s on a cold compile cache
def test_bf16_weights_are_packed_only_where_this_cpu_packs_them(monkeypatch):
    """oneDNN packs bf16 weights only with AVX512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere (an
    AMD EPYC without AVX512, many laptops) packing raised at the first step and took the
    engine down. The probe says no there, and the graph runs on the live weights."""
    from rollwise.engine import graph_model

    def refuses(*a, **k):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                           "avx_ne_convert or avx512bw, avx512vl and avx512dq")
    model = contract.wild_model()[0].to(torch.bfloat16)
    graph_model.bf16_packing_works.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuses)
    try:
        assert not graph_model.bf16_packing_works() and not graph_model.can_pack(model)
        got = engine(model, graph="eager").generate([Request(PROMPTS[0], SAMPLED)])
        assert len(got[0].token_ids) == SAMPLED.max_new_tokens
    finally:
        graph_model.bf16_packing_works.cache_clear()
    assert not graph_model.can_pack(model.float())


def test_behaviour_logprobs_in_bf16_are_as_close_as_the_runners():
    """bf16 logits hold 3 significant digits, and a cached decode rounds differently from a
    full forward pass: neither path is within 2e-3 of it (BENCHMARKS.md gives the measured
    gap on SmolLM2); the graph's errors are the runner's size."""
    model = scaled_model(0.15, torch.bfloat16)
    params = [dataclasses.replace(SAMPLED, seed=s) for s in range(6)]
    graph, runner = (logprob_errors(model, g, params) for g in ("compile", "off"))
    assert graph.mean() < 1.5 * runner.mean() and graph.max() < 2 * runner.max()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(
    torch.bfloat16, marks=pytest.mark.integration)])  # bf16 compiles its own graph (as above)
def test_weights_written_in_place_take_effect_at_the_next_pass(dtype):
    """A compiled engine that has run keeps no stale copy: new weights written through
    load_weights, or straight into the model's tensors (no call at all), give the tokens a
    fresh engine built on them gives. bf16 on a CPU uses packed copies of the weights."""
    old = contract.wild_model(seed=1)[0].to(dtype)
    new = contract.wild_model(seed=2)[0].to(dtype)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    reqs = [Request(p, greedy) for p in PROMPTS]
    fresh = [c.token_ids for c in engine(new).generate(reqs)]
    synced = engine(old)
    assert [c.token_ids for c in synced.generate(reqs)] != fresh
    synced.load_weights(new.state_dict(), version=1)
    assert [c.token_ids for c in synced.generate(reqs)] == fresh
    written = engine(old)
    written.generate(reqs)
    with torch.no_grad():
        for name, t in written.model.state_dict().items():
            t.copy_(new.state_dict()[name])
    assert [c.token_ids for c in written.generate(reqs)] == fresh


def test_a_sync_mid_stream_applies_to_the_next_window(wild):
    """Sequences in flight when the weights change continue under the new weights from their
    next token, as on the runner's path (their earlier K/V stays as computed)."""
    new = contract.wild_model(seed=5)[0]
    params = dataclasses.replace(SAMPLED, seed=3, max_new_tokens=15)
    results = {}
    for graph in ("off", "compile"):
        eng = engine(wild, graph=graph)
        sid = eng.add(Request(PROMPTS[2], params))
        events = contract.run_to_tokens(eng, sid, 5)
        eng.load_weights(new.state_dict(), version=1)
        events += contract.drain(eng)
        results[graph] = [(e.token_ids, e.versions) for e in events]
    assert results["compile"] == results["off"]
    assert {v for _, vs in results["off"] for v in vs} == {0, 1}


def test_padded_batches_change_nothing(wild):
    """CUDA pads a window's rows up to a bucket (the padding rows idle in free slots); on the
    CPU with padding forced, the tokens are the unpadded ones."""
    reqs = [Request(p, dataclasses.replace(SAMPLED, seed=i, max_new_tokens=5 + i))
            for i, p in enumerate(PROMPTS[:3])]
    plain = engine(wild, max_batch=8).generate(reqs)
    padded = engine(wild, max_batch=8)
    padded.generate(reqs[:1])  # builds the graph
    padded.graph.pad_rows = 8
    got = padded.generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]


def test_hidden_states_and_top_logprobs_inside_windows(wild):
    params = dataclasses.replace(SAMPLED, seed=6, max_new_tokens=9, return_hidden=True,
                                 top_logprobs=3)
    got = engine(wild).generate([Request(PROMPTS[4], params)])[0]
    want = engine(wild, graph="off").generate([Request(PROMPTS[4], params)])[0]
    assert got.token_ids == want.token_ids
    assert (got.hidden - want.hidden).abs().max() < 1e-5
    assert [[t for t, _ in row] for row in got.top_logprobs] == \
        [[t for t, _ in row] for row in want.top_logprobs]
    assert max(abs(a - b) for r, s in zip(got.top_logprobs, want.top_logprobs)
               for (_, a), (_, b) in zip(r, s)) < 1e-5
