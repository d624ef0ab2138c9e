"""The supervised warm start (rollwise.training.sft): it says where it is from its first step,
and its cache is keyed by the examples the run's generator writes."""

from rollwise import models
from rollwise.config import load_config
from rollwise.tasks import load_task
from rollwise.training import sft

TINY = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=32", "task.train_size=40",
        "task.eval_size=8", "sft.batch_size=4"]


def test_the_warm_start_reports_its_first_step_and_then_at_least_every_few_seconds(monkeypatch):
    cfg = load_config(None, TINY + ["sft.steps=5", "sft.eval_every=100"])
    task = load_task(cfg.task)
    lines: list[str] = []
    sft.train_sft(*models.build(cfg.model), task, cfg, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == ["sft step 1/5", "sft step 5/5"]
    monkeypatch.setattr(sft, "PROGRESS_EVERY_S", 0.0)
    lines.clear()
    sft.train_sft(*models.build(cfg.model), task, cfg, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == [f"sft step {i}/5" for i in range(1, 6)]


def test_the_cache_key_follows_the_examples(tmp_path):
    cfg = load_config(None, TINY + [f"run.root={tmp_path}"])
    task = load_task(cfg.task)
    tok = models.build_tokenizer(cfg.model)
    examples = sft.examples_for(cfg, task, tok)
    assert sft.warm_start_path(cfg, task) == sft.cache_path(cfg, examples)
    assert sft.cache_path(cfg, examples[:-1]) != sft.cache_path(cfg, examples)
