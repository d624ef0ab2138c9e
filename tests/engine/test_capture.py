"""The decode graph's captured path (rollwise/engine/capture.py and DecodeGraph._replay) on the
CPU: a capturer that replays the pass faithfully stands in for CUDA graphs, so the replay logic
(one eager pass, then replays; rows that stop run on masked to the window's end) is checked
against the runner's path; capturers that fail, or replay other tokens or log-probabilities,
must leave the run on uncaptured passes with the same tokens, said once."""

import dataclasses
import logging

import engine_contract as contract
import pytest
from engine_contract import PROMPTS

from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.capture import REPLAY_LOGP_TOLERANCE

SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=12)


class Faithful:
    """A CUDA graph's contract without CUDA: capture records the pass, replay runs it."""

    def __init__(self):
        self.captured = 0

    def warm(self, run_pass):
        run_pass()

    def capture(self, run_pass):
        self.captured += 1
        return run_pass


class Refusing(Faithful):
    def capture(self, run_pass):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class Skewed(Faithful):
    """Replays the pass through a sampler whose tokens or log-probabilities are moved."""

    def __init__(self, graph, tokens: int = 0, logprob: float = 0.0):
        super().__init__()
        self.graph, self.tokens, self.logprob = graph, tokens, logprob

    def capture(self, run_pass):
        super().capture(run_pass)
        real, vocab = self.graph._sample, self.graph.runner.model.config.vocab_size

        def skewed(*args):
            tokens, logp, ent = real(*args)
            return (tokens + self.tokens) % vocab, logp + self.logprob, ent

        def replay():
            self.graph._sample = skewed
            try:
                run_pass()
            finally:
                self.graph._sample = real
        return replay


@pytest.fixture(scope="module")
def wild():
    return contract.wild_model()[0]


def requests(stop: int | None = None) -> list[Request]:
    params = [dataclasses.replace(SAMPLED, seed=s, max_new_tokens=6 + 2 * s,
                                  stop_ids=(stop,) if stop is not None else ())
              for s in range(len(PROMPTS))]
    return [Request(p, q) for p, q in zip(PROMPTS, params)]


def outputs(completions) -> list:
    return [(c.token_ids, c.finish_reason) for c in completions]


def runner_outputs(model, reqs):
    got = BuiltinEngine(model, max_batch=4, segment=5, graph="off").generate(reqs)
    return outputs(got), [c.logprobs for c in got]


def captured_engine(model, make_capturer):
    """An engine on the decode graph whose windows go through `make_capturer(graph)`."""
    eng = BuiltinEngine(model, max_batch=4, segment=5, graph="eager")
    eng.generate([Request(PROMPTS[0], dataclasses.replace(SAMPLED, max_new_tokens=2))])
    eng.graph.capturer = make_capturer(eng.graph)
    return eng


def a_stop_token(model) -> int:
    """A token the sampled answers contain, so some stop inside a window."""
    first = BuiltinEngine(model, max_batch=4, segment=5, graph="off").generate(requests())
    return max(range(50), key=lambda t: sum(c.token_ids[1:].count(t) for c in first))


def test_replayed_windows_sample_what_the_runner_samples(wild):
    """Continuous batching through captured windows (6 requests, 4 slots, stops inside
    windows): the runner's tokens, stops and log-probabilities; each bucket captured once."""
    reqs = requests(a_stop_token(wild))
    want, want_lp = runner_outputs(wild, reqs)
    eng = captured_engine(wild, lambda graph: Faithful())
    got = eng.generate(reqs)
    assert outputs(got) == want
    assert {reason for _, reason in want} == {"stop", "length"}
    assert max(abs(a - b) for c, w in zip(got, want_lp) for a, b in zip(c.logprobs, w)) < 1e-5
    assert eng.graph.captures == eng.graph.capturer.captured > 0
    assert eng.graph.capture_note is None
    before = eng.graph.captures
    assert outputs(eng.generate(reqs)) == want
    assert eng.graph.captures == before  # the same buckets replay what was captured


@pytest.mark.parametrize("make_capturer, said", [
    (lambda graph: Refusing(), "capture failed (RuntimeError: CUDA error: operation not"),
    (lambda graph: Skewed(graph, tokens=1), "other tokens than the eager pass"),
    (lambda graph: Skewed(graph, logprob=10 * REPLAY_LOGP_TOLERANCE), "log-probabilities"),
], ids=["refused", "other-tokens", "other-logprobs"])
def test_a_capture_that_fails_or_disagrees_falls_back_once(wild, caplog, make_capturer, said):
    """The run goes on uncaptured with the runner's tokens and log-probabilities (the
    disagreeing replay's pass is done again eagerly, its K/V rewritten), says why once, and
    captures nothing more."""
    reqs = requests(a_stop_token(wild))
    want, want_lp = runner_outputs(wild, reqs)
    eng = captured_engine(wild, make_capturer)
    with caplog.at_level(logging.WARNING, logger="rollwise.engine.decode_graph"):
        first, second = eng.generate(reqs), eng.generate(reqs)
    for got in (first, second):
        assert outputs(got) == want
        assert max(abs(a - b) for c, w in zip(got, want_lp)
                   for a, b in zip(c.logprobs, w)) < 1e-5
    notes = [r.getMessage() for r in caplog.records if "without captured graphs" in r.message]
    assert len(notes) == 1 and said in notes[0]
    assert said in eng.graph.capture_note and eng.graph.captures == 0
    if isinstance(eng.graph.capturer, Skewed):
        assert eng.graph.capturer.captured == 1  # given up at the first disagreement
