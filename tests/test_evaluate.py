"""Held-out pass@1: greedy, or the mean over seeded samples per prompt."""

import pytest

from rollwise.config import ConfigError, load_config
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.evaluate import EVAL_SEED, evaluate
from rollwise.tasks.prompts import Prompter
from rollwise.types import Problem


def parity(text, problem):
    """A reward a random model earns about half the time, so averages are not 0 or 1."""
    return float(len(text) % 2 == 0), "parity"


PROBLEMS = [Problem(f"p{i}", f"{i}+{i}=", str(2 * i), tier="ab"[i % 2]) for i in range(6)]


def test_sampled_pass1_is_the_mean_over_each_prompts_seeded_draws(tiny):
    model, tok = tiny
    engine = BuiltinEngine(model)
    got = evaluate(engine, Prompter.plain(tok), PROBLEMS, parity, 8, samples=3, temperature=1.0)
    # the naive way: every draw on its own, one request at a time, averaged per prompt
    per_prompt = []
    for i, p in enumerate(PROBLEMS):
        wins = []
        for j in range(3):
            params = SamplingParams(temperature=1.0, max_new_tokens=8,
                                    stop_ids=(tok.eos_token_id,), seed=EVAL_SEED + i * 3 + j)
            c = engine.generate([Request(tok(p.prompt)["input_ids"], params)])[0]
            wins.append(parity(tok.decode(c.token_ids, skip_special_tokens=True), p)[0])
        per_prompt.append(sum(wins) / 3)
    assert got["eval/pass1"] == pytest.approx(sum(per_prompt) / 6)
    assert got["eval/pass1/a"] == pytest.approx(sum(per_prompt[0::2]) / 3)
    assert 0 < got["eval/pass1"] < 1  # the draws differ, so the test can tell means apart
    again = evaluate(engine, Prompter.plain(tok), PROBLEMS, parity, 8, samples=3, temperature=1.0)
    assert again == got


def test_many_greedy_samples_are_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="temperature > 0"):
        evaluate(BuiltinEngine(model), Prompter.plain(tok), PROBLEMS, parity, 8, samples=4)
    with pytest.raises(ConfigError, match="run.eval_temperature"):
        load_config(None, ["run.eval_samples=4"])
