"""Weight sync through real RL steps: the rollwise Trainer (fp32 master weights, AdamW, PPO-clip
on GRPO advantages) updates on groups the engine generated; after k updates one sparse payload
brings a bf16 (or fp32) engine to the trainer's weights bit for bit, and full and sparse
engines generate the same tokens. The share of changed bf16 weights rises with the learning
rate, as SparseRL-Sync predicts (docs/methods.md#sparse-sync)."""

import copy

import pytest
import torch
from sync_helpers import rl_groups

from rollwise.config import TrainConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.sync import WeightSync
from rollwise.sync.payload import bits
from rollwise.sync.transport import InProcessTransport
from rollwise.training.trainer import Trainer


def make(tiny, lr: float, engine_dtype: torch.dtype, mode: str = "sparse"):
    model, tok = tiny
    model = copy.deepcopy(model)
    trainer = Trainer(model, TrainConfig(lr=lr, minibatches=2, steps=10), pad_id=tok.pad_token_id)
    engine = BuiltinEngine(model, seed=1)
    engine.model.to(engine_dtype)
    sync = WeightSync(trainer, InProcessTransport(engine), mode=mode)
    return trainer, engine, sync


def assert_bit_identical(engine, trainer):
    for name, t in engine.model.state_dict().items():
        want = trainer.model.state_dict()[name].detach().to(t.dtype)
        assert torch.equal(bits(t), bits(want)), name


@pytest.mark.parametrize("engine_dtype, lr", [(torch.bfloat16, 1e-6), (torch.float32, 1e-4)])
def test_k_real_rl_steps_then_one_sparse_sync_is_bit_exact(tiny, engine_dtype, lr):
    trainer, engine, sync = make(tiny, lr, engine_dtype)
    first = sync.push()  # a new engine: full
    assert first["sync/sparse"] == 0.0
    _, tok = tiny
    for step in range(3):  # rollouts from the engine's (stale) weights, as in an async run
        groups = rl_groups(engine, tok)
        assert any(g.is_mixed for g in groups)
        trainer.update(groups)
    m = sync.push()
    assert m["sync/sparse"] == 1.0 and m["sync/density"] > 0
    if engine_dtype == torch.bfloat16:  # fp32 Adam steps move almost every fp32 weight
        assert m["sync/density"] < 0.2 and m["sync/bytes"] < 0.6 * m["sync/full_bytes"]
    assert engine.version == trainer.version == 3
    assert_bit_identical(engine, trainer)


def test_full_and_sparse_engines_stay_identical_over_a_run(tiny):
    _, tok = tiny
    trainer, sparse_engine, sparse = make(tiny, 1e-6, torch.bfloat16)
    full_engine = BuiltinEngine(trainer.model, seed=1)
    full_engine.model.to(torch.bfloat16)
    full = WeightSync(trainer, InProcessTransport(full_engine), mode="full")
    sparse.push(), full.push()
    for step in range(3):
        groups = rl_groups(sparse_engine, tok)
        trainer.update(groups)
        ms, mf = sparse.push(), full.push()
        assert ms["sync/bytes"] < mf["sync/full_bytes"] <= mf["sync/bytes"]
    assert_bit_identical(sparse_engine, trainer)
    assert_bit_identical(full_engine, trainer)
    req = [Request(tok("12+3=")["input_ids"], SamplingParams(max_new_tokens=6, seed=5), 0)]
    assert sparse_engine.generate(req)[0].token_ids == full_engine.generate(req)[0].token_ids


def test_density_rises_with_the_learning_rate(tiny):
    _, tok = tiny
    density = {}
    for lr in (1e-6, 1e-4, 1e-2):
        trainer, engine, sync = make(tiny, lr, torch.bfloat16)
        sync.push()
        trainer.update(rl_groups(engine, tok))
        density[lr] = sync.push()["sync/density"]
    assert 0 < density[1e-6] < density[1e-4] < density[1e-2]
