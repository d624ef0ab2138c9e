"""An evaluation's progress note counts its answers generated (the engine's finished
sequences) and scored (the held-out scorer's progress) out of the total, so a long
evaluation never reads as stuck at '0 tokens'."""

from types import SimpleNamespace

from rollwise.config import ModelConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.loop.run import Run
from rollwise.models import build


def test_the_eval_note_counts_answers_generated_and_scored():
    model, _ = build(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64), seed=0)
    engine = BuiltinEngine(model, copy_model=False)
    scorer = SimpleNamespace(scoring=(5, 9))  # left from an earlier evaluation
    run = SimpleNamespace(engine=engine, eval_scorer=scorer, task=SimpleNamespace(eval=[0] * 3),
                          cfg=SimpleNamespace(run=SimpleNamespace(eval_samples=2)))
    note = Run.eval_note(run)
    assert note() == "held-out answers: 0/6 generated, 0/6 scored"
    engine.generate([Request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4), i)
                     for i in range(4)])
    scorer.scoring = (2, 6)  # as HeldOutScorer.score_all reports it while its workers score
    assert note() == "held-out answers: 4/6 generated, 2/6 scored"
    assert engine.answers_finished == 4


def test_the_progress_notes_say_a_compile_instead_of_zero_tokens():
    """The first start's compile of the decode graph takes minutes with no token made: the
    generate and eval notes say what the engine is doing then (BuiltinEngine.busy_with)."""
    engine = SimpleNamespace(tokens_generated=0, answers_finished=0, busy_with="")
    scorer = SimpleNamespace(scoring=(0, 0))
    run = SimpleNamespace(engine=engine, eval_scorer=scorer, task=SimpleNamespace(eval=[0] * 3),
                          cfg=SimpleNamespace(run=SimpleNamespace(eval_samples=1)))
    tokens, held_out = Run.tokens_note(run), Run.eval_note(run)
    assert tokens() == "0 tokens" and held_out().startswith("held-out answers: 0/3")
    engine.busy_with = "compiling the decode graph (once per model and torch version: ...)"
    assert tokens() == held_out() == engine.busy_with
    engine.busy_with, engine.tokens_generated = "", 12
    assert tokens() == "12 tokens"
