"""The engine contract (tests/engine_contract.py) on every in-CI engine: the built-in engine in
this process, the built-in engine in a child process (sync.transport=process), and the minimal
reference engine of tests/engine_reference.py; float32, tolerance 1e-4. vLLM runs the same
checks in tests/with_vllm/test_vllm_contract.py. Small max_batch and segment so every check crosses
continuous-batching and segment boundaries."""

import engine_contract as contract
import pytest
from engine_reference import ReferenceEngine

from rollwise.engine import BuiltinEngine, Engine
from rollwise.engine.base import SequenceControl, Weights
from rollwise.engine.process import EngineProcess

TOL = 1e-4
SEGMENT = 4


def builtin(model, **kw):
    """The runner's path: the Hugging Face model's own forward."""
    return BuiltinEngine(model, **({"max_batch": 3, "segment": SEGMENT, "graph": "off"} | kw))


def graph_eager(model, **kw):
    """The decode graph without torch.compile: its arithmetic and window state."""
    return builtin(model, **({"graph": "eager"} | kw))


def graph_compiled(model, **kw):
    """The decode graph as the engine runs it on a CPU: layers, head and sampler compiled."""
    return builtin(model, **({"graph": "compile"} | kw))


def child_process(model, **kw):
    return EngineProcess(model, **({"max_batch": 3, "segment": SEGMENT} | kw))


def reference(model, **kw):
    return ReferenceEngine(model, segment=SEGMENT, **kw)


# compiling takes a minute, and a child process starts an interpreter per test: both with the
# integration tests (tests/engine/test_sync_process.py checks the child engine in the unit suite)
ENGINES = [builtin, graph_eager, pytest.param(graph_compiled, marks=pytest.mark.integration),
           pytest.param(child_process, marks=pytest.mark.integration), reference]


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()


@pytest.fixture(params=ENGINES, ids=["builtin", "graph_eager", "graph_compiled", "child_process",
                                      "reference"])
def make(request):
    made = []

    def build(model, **kw):
        made.append(request.param(model, **kw))
        return made[-1]
    yield build
    for e in made:
        e.close()


def test_implements_the_protocols(wild, make):
    engine = make(wild[0])
    protocols = (Engine, SequenceControl) + \
        (() if isinstance(engine, EngineProcess) else (Weights,))  # synced by ProcessTransport
    for p in protocols:
        assert isinstance(engine, p), p.__name__


def test_greedy_matches_hf_generate(wild, make):
    contract.check_greedy_matches_hf(make(wild[0]), wild[0])


def test_logprobs_and_entropies_match_full_forward(wild, make):
    contract.check_logprobs_match_forward(make(wild[0]), wild[0], TOL)


def test_fork_continues_as_an_unforked_copy(wild, make):
    contract.check_fork_continues_as_copy(make(wild[0]), wild[0], TOL, SEGMENT)


def test_pause_resume_logprobs_match_full_forward(wild, make):
    contract.check_pause_resume(make(wild[0]), wild[0], TOL)


def test_abort_frees_and_others_finish(wild, make):
    contract.check_abort(make(wild[0]))


def test_events_every_segment_and_at_the_end(wild, make):
    contract.check_segments(make(wild[0]), SEGMENT)


def test_top_logprobs_of_the_sampled_distribution(wild, make):
    contract.check_top_logprobs(make(wild[0]), wild[0], TOL)


def test_load_weights_stamps_version_and_follows_new_weights(make):
    model, _ = contract.wild_model(seed=1)
    engine = make(model)
    new, _ = contract.wild_model(seed=2)
    contract.check_load_weights(engine, new, new.state_dict(), version=3)


def test_state_dict_restores_the_request_seed_stream(wild, make):
    from rollwise.engine import Request, SamplingParams
    a, b = make(wild[0]), make(wild[0], seed=123)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)  # seeds from the engine's stream
    a.generate([Request(p, params) for p in contract.PROMPTS[:2]])
    b.load_state_dict(a.state_dict())
    got = [c.token_ids for c in a.generate([Request(p, params) for p in contract.PROMPTS])]
    assert got == [c.token_ids for c in b.generate([Request(p, params)
                                                    for p in contract.PROMPTS])]
