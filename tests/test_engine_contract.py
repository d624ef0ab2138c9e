"""The engine contract (tests/engine_contract.py) on the built-in engine, float32, tolerance 1e-4.
Small max_batch and segment so every check crosses continuous-batching and segment boundaries."""

import pytest

import engine_contract as contract
from rollwise.engine import Engine

TOL = 1e-4
SEGMENT = 4


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()


def make(model, **kw):
    return Engine(model, **({"max_batch": 3, "segment": SEGMENT} | kw))


def test_greedy_matches_hf_generate(wild):
    contract.check_greedy_matches_hf(make(wild[0]), wild[0])


def test_logprobs_and_entropies_match_full_forward(wild):
    contract.check_logprobs_match_forward(make(wild[0]), wild[0], TOL)


def test_fork_continues_as_an_unforked_copy(wild):
    contract.check_fork_continues_as_copy(make(wild[0]), wild[0], TOL, SEGMENT)


def test_pause_resume_logprobs_match_full_forward(wild):
    contract.check_pause_resume(make(wild[0]), wild[0], TOL)


def test_abort_frees_and_others_finish(wild):
    contract.check_abort(make(wild[0]))


def test_events_every_segment_and_at_the_end(wild):
    contract.check_segments(make(wild[0]), SEGMENT)


def test_top_logprobs_of_the_sampled_distribution(wild):
    contract.check_top_logprobs(make(wild[0]), wild[0], TOL)


def test_load_weights_stamps_version_and_follows_new_weights():
    model, _ = contract.wild_model(seed=1)
    engine = make(model)
    new, _ = contract.wild_model(seed=2)
    contract.check_load_weights(engine, new, new.state_dict(), version=3)
