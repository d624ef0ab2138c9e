"""XRPO's in-context seeding: when a prompt is stuck, which exemplars it gets (never a held-out
problem, the most similar solved ones), how they are laid out, the length bound, that only the
response is trained, and a run that seeds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rollwise import models
from rollwise.config import TaskConfig, load_config
from rollwise.loop.run import train
from rollwise.stages.control.seed_icl import IclSeeder
from rollwise.tasks.prompts import Prompter
from rollwise.types import Batch, Group, Problem, Sample
from tests.loop_helpers import SMALL, rows


def _cfg(*extra):
    return load_config(None, ["control.icl_seeding.exemplars=2", "control.icl_seeding.after=2",
                              *extra])


def _problem(pid: str, text: str, solution: str | None = None) -> Problem:
    return Problem(id=pid, prompt=text, answer="1", solution=solution)


def _group(p: Problem, rewards: list[int], response=(5, 6)) -> Group:
    samples = [Sample(prompt_id=p.id, prompt_ids=[1, 2], response_ids=list(response))
               for _ in rewards]
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    return Group(p.id, samples, p)


TRAIN = [_problem("t0", "12+34=", "46"), _problem("t1", "12+35=", "47"),
         _problem("t2", "90-10=", None), _problem("stuck", "12+36=", "48")]
EVAL = [_problem("e0", "12+37=", "49")]  # the closest to the stuck prompt: must never be used


def _seeder(prompter=None, **cfg):
    s = IclSeeder(_cfg(*[f"control.icl_seeding.{k}={v}" for k, v in cfg.items()]))
    s.bind(task=SimpleNamespace(train=TRAIN, eval=EVAL), prompter=prompter)
    return s


def test_a_prompt_is_seeded_after_its_zero_streak_with_the_most_similar_solved_exemplars():
    seeder = _seeder()
    stuck = TRAIN[3]
    seeder.observe([_group(TRAIN[0], [1, 0]), _group(TRAIN[1], [0, 1]), _group(TRAIN[2], [1, 1]),
                    _group(EVAL[0], [1, 1]),  # a held-out id in the outcomes is never banked
                    _group(stuck, [0, 0])], 1)
    assert seeder.transform([stuck]) == [stuck]  # one zero group: not stuck yet
    seeder.observe([_group(stuck, [0, 0, 0])], 2)
    [seeded] = seeder.transform([stuck])
    assert "e0" not in seeder.bank
    assert seeded.id == "stuck"
    # the two most similar solved problems, as earlier turns, the worked solution as answer
    assert seeded.prompt == [{"role": "user", "content": "12+34="},
                             {"role": "assistant", "content": "46"},
                             {"role": "user", "content": "12+35="},
                             {"role": "assistant", "content": "47"},
                             {"role": "user", "content": "12+36="}]
    assert seeder.metrics() == {"control/icl_seeding/seeded": 1.0,
                                "control/icl_seeding/stuck": 1.0,
                                "control/icl_seeding/bank": 2.0}  # t2: no text to show
    seeder.observe([_group(stuck, [0, 1])], 3)  # solved once: asked plain again
    assert seeder.transform([stuck]) == [stuck]


def test_without_a_worked_solution_the_policys_correct_response_is_the_exemplar():
    tok = models.char_tokenizer()
    seeder = _seeder(Prompter.plain(tok), exemplars=1)
    response = tok("80")["input_ids"]
    seeder.observe([_group(TRAIN[2], [0, 1], response), _group(TRAIN[3], [0])], 1)
    seeder.observe([_group(TRAIN[3], [0])], 2)
    assert seeder.bank["t2"] == ["90-10=", "80"]
    assert seeder.transform([TRAIN[3]])[0].prompt[1] == {"role": "assistant", "content": "80"}


def test_exemplars_are_dropped_until_the_prompt_fits_and_the_response_alone_is_trained():
    tok = models.char_tokenizer()
    prompter = Prompter(TaskConfig(chat_template="off", prompt_template="Q: {prompt}"), tok)
    plain_len = len(prompter.encode(TRAIN[3].prompt))
    one_shot = len(prompter.encode([{"role": "user", "content": "Q: 12+34="},
                                    {"role": "assistant", "content": "46"},
                                    {"role": "user", "content": "12+36="}]))
    seeder = _seeder(prompter, max_prompt_tokens=one_shot)
    seeder.observe([_group(TRAIN[0], [1]), _group(TRAIN[1], [1]), _group(TRAIN[3], [0])], 1)
    seeder.observe([_group(TRAIN[3], [0])], 2)
    [seeded] = seeder.transform([TRAIN[3]])
    assert len(seeded.prompt) == 3  # one exemplar fits, two do not
    ids = prompter.ids(seeded)
    assert ids == prompter.encode(seeded.prompt)  # made with the seeded prompt
    assert len(ids) == one_shot > plain_len
    assert prompter.render_text(seeded.prompt) == "Q: 12+34=\n46\nQ: 12+36="  # template on both
    sample = Sample(prompt_id="stuck", prompt_ids=ids, response_ids=[7, 8, 9],
                    logprobs=[-1.0] * 3, versions=[0] * 3, loss_mask=[1] * 3)
    batch = Batch.from_samples([sample], [1.0], pad_id=0)
    trained = batch.loss_mask[0].nonzero().flatten().tolist()
    assert trained == [len(ids) - 1, len(ids), len(ids) + 1]  # the response's targets only
    tight = _seeder(prompter, max_prompt_tokens=plain_len)
    tight.observe([_group(TRAIN[0], [1]), _group(TRAIN[3], [0])], 1)
    tight.observe([_group(TRAIN[3], [0])], 2)
    assert tight.transform([TRAIN[3]]) == [TRAIN[3]]  # nothing fits: asked plain


def test_seeding_state_round_trips():
    seeder = _seeder()
    seeder.observe([_group(TRAIN[0], [1]), _group(TRAIN[3], [0])], 1)
    restored = _seeder()
    restored.load_state_dict(json.loads(json.dumps(seeder.state_dict())))
    assert restored.state_dict() == seeder.state_dict()


@pytest.mark.integration
def test_a_run_seeds_stuck_prompts_with_training_problems_only(tmp_path):
    cfg = load_config(None, SMALL + ["control.icl_seeding.exemplars=1",
                                     "control.icl_seeding.after=1", "task.train_size=24",
                                     f"run.root={tmp_path}", "run.name=r"])
    train(cfg)
    metrics = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert sum(m.get("control/icl_seeding/seeded", 0) for m in metrics) > 0
    seeded = [r["prompt_text"].split("\n") for r in rows(tmp_path / "r")
              if "\n" in r["prompt_text"]]  # exemplar turns, one per line (plain prompts)
    assert seeded
    from rollwise.tasks import load_task
    task = load_task(cfg.task)
    train_prompts = {p.prompt for p in task.train}
    held_out = {p.prompt for p in task.eval} - train_prompts
    for lines in seeded:
        questions = lines[0::2]  # exemplar question, its answer, ..., the stuck prompt
        assert len(lines) % 2 == 1 and set(questions) <= train_prompts
        assert not set(questions) & held_out


def test_the_models_context_bounds_the_seeded_prompt():
    tok = models.char_tokenizer()
    prompter = Prompter.plain(tok)
    cfg = _cfg("generate.max_new_tokens=20")
    seeder = IclSeeder(cfg)
    policy = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=30))
    seeder.bind(task=SimpleNamespace(train=TRAIN, eval=EVAL), prompter=prompter, policy=policy)
    assert seeder.max_tokens == 10  # 30 positions less 20 for the response
    seeder.observe([_group(TRAIN[0], [1]), _group(TRAIN[3], [0])], 1)
    seeder.observe([_group(TRAIN[3], [0])], 2)
    assert seeder.transform([TRAIN[3]]) == [TRAIN[3]]  # "12+34=\n46\n12+36=" is 16 tokens
