"""Held-out pass@1 of a training run compares each response with the true answer by the rule
that fits the run's reward: math-verify for `math`, the tests for `code`, the user's function,
and a weighted dict's ground-truth verifier. (Before, every reward but math_verify was
evaluated by exact match.) The engine is scripted, so the responses are known."""

import json

import pytest

from rollwise import models
from rollwise.config import load_config
from rollwise.engine import Completion
from rollwise.loop.run import Run
from rollwise.report.progress import Progress

pytestmark = pytest.mark.integration  # whole training loops

ROWS = [  # prompt, true answer, what the scripted policy answers, and its tests for `code`
    ("one plus one", "2", "2.0"),          # right under math, wrong under exact
    ("two times three", "6", "5"),          # wrong everywhere
    ("half of eight", "4", "print(2*2)"),   # a program that prints the answer
    ("twelve reversed", "12", "21"),        # right under the user's reversing rule
]


class ScriptedEngine:
    """The engine protocol's generate, answering each prompt with a fixed response."""

    def __init__(self, tok, answers: dict[str, str]):
        self.tok, self.answers = tok, answers
        self.version, self.tokens_generated = 0, 0

    def has_unfinished(self) -> bool:
        return False

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.answers[self.tok.decode(r.prompt_ids, skip_special_tokens=True)]
            ids = self.tok(text)["input_ids"]
            out.append(Completion(r.id, ids, [0.0] * len(ids), [0.0] * len(ids),
                                  [0] * len(ids), "stop"))
        return out


@pytest.fixture
def init(tmp_path, tiny):
    models.save(*tiny, tmp_path / "init")
    return tmp_path / "init"


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "rows.jsonl"
    with path.open("w") as f:
        for prompt, answer, _ in ROWS:
            row = {"prompt": prompt, "answer": answer,
                   "tests": [{"input": "", "output": answer}]}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("reward, right", [
    ("exact", []),
    ("math", ["one plus one"]),
    ("code", ["half of eight"]),
    ("filter_userfns:flaky", ["twelve reversed"]),
    ("{math: 1.0, length: 0.5}", ["one plus one"]),
    ("{format: 0.2, code: 1.0}", ["half of eight"]),
])
def test_held_out_pass1_uses_the_rule_that_fits_the_reward(tmp_path, init, dataset, reward,
                                                           right):
    cfg = load_config(None, [f"filter.reward={reward}", "task.name=file",
                             f"task.path={dataset}", f"task.eval_path={dataset}",
                             f"run.init={init}", "filter.workers=0", f"run.root={tmp_path}",
                             "run.log=quiet", "generate.max_new_tokens=16"])
    run = Run(cfg, Progress("quiet", 1))
    run.engine = ScriptedEngine(run.tokenizer, {p: resp for p, _, resp in ROWS})
    got = run.evaluate()["eval/pass1"]
    assert got == pytest.approx(len(right) / len(ROWS))
    run.filter.close()
