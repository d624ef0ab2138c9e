"""LoRA with vLLM (engine.backend=vllm, train.lora): vLLM applies the adapters with its own
LoRA layers, reloaded in place at each sync (the base weights are loaded once). What it
computes equals the merged model's greedy tokens, and its behaviour log-probabilities stay
within the loop tests' tolerance of the trainer's."""

import copy
import json
import os

import pytest
import torch

from rollwise import models
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.backends import build_engine
from rollwise.loop.run import train
from rollwise.report.progress import Progress
from rollwise.sync import build_sync
from rollwise.training.trainer import Trainer

pytestmark = pytest.mark.vllm
BEHAVIOUR_TOL = 1e-3  # as tests/with_vllm/test_vllm_loop.py
LORA = ["train.lora.rank=4", "train.lora.targets=all-linear", "engine.backend=vllm"]


@pytest.fixture(autouse=True)
def small_kv_cache():
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def test_vllm_applies_synced_adapters_as_the_merged_model_computes(tmp_path):
    cfg = load_config(None, [*LORA, f"run.root={tmp_path}", "engine.max_batch=16"])
    model, tok = models.build(cfg.model, seed=0)
    engine = build_engine(cfg, model, tok, tmp_path / "a")  # the base, before peft wraps it
    trainer = Trainer(model, cfg.train, pad_id=tok.pad_token_id)
    sync = build_sync(cfg.sync, trainer, engine)
    assert engine._native is not None  # vLLM's own LoRA layers, not a merged reload
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    trainer.version = 1
    sync.push()
    sync.compare()  # the adapters vLLM loaded from are the trainer's, bit for bit
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    reqs = [Request(tok(f"{a}+{b}=")["input_ids"], params, i)
            for i, (a, b) in enumerate([(1, 3), (25, 7), (9, 90), (40, 2)])]
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    base = BuiltinEngine(copy.deepcopy(trainer.model).unload()).generate(reqs)
    got, want = engine.generate(reqs), BuiltinEngine(merged).generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.token_ids for c in got] != [c.token_ids for c in base]  # the adapters count
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < BEHAVIOUR_TOL
    assert all(v == [1] * len(v) for v in (c.versions for c in got))


def test_a_lora_run_on_vllm_trains_within_the_behaviour_tolerance(tmp_path):
    steps = 4
    small = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=128", "task.train_size=300",
             "task.eval_size=40", "sft.steps=20", "control.prompts_per_step=6",
             "generate.group_size=4", "engine.max_batch=32",  # a warm start of seconds
             "filter.reward=tests.loop_helpers:parity", "filter.workers=0"]  # mixed groups
    cfg = load_config(None, [*LORA, *small, f"run.root={tmp_path}", "run.name=lora",
                             f"train.steps={steps}", f"run.eval_every={steps}",
                             "run.report=false", "run.log=quiet", "train.lr=1e-2",
                             "sync.check=true"])
    out = train(cfg, Progress("quiet", steps))
    rows = [json.loads(x) for x in (tmp_path / "lora" / "metrics.jsonl").open()][1:]
    assert [r["policy/version"] for r in rows] == list(range(1, steps + 1))
    gaps = [r["train/behaviour_gap_max"] for r in rows if "train/behaviour_gap_max" in r]
    assert gaps and max(gaps) <= BEHAVIOUR_TOL, gaps  # steps that trained
    assert (tmp_path / "lora" / "model" / "adapter_model.safetensors").exists()
    assert out["tokens_trained"] > 0
