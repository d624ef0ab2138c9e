"""run.memory_gib (rollwise/memory_budget.py): the fixed part against a count by hand, sizes
that stay at what pays whatever the budget, sizes cut to a budget that binds, and a budget that
cannot hold the run refused before any work with what to lower."""

import pytest
import yaml

from rollwise.config import load_config
from rollwise.engine import sizing
from rollwise.errors import ConfigError
from rollwise.loop.run import train
from rollwise.memory_budget import (
    AUTO_MAX_TOKENS,
    GIB,
    RUNTIME_BYTES,
    ModelShape,
    fixed_bytes,
    plan_memory,
    shape_from_config,
    step_kv_tokens,
)

SHAPE = ModelShape(params=100_000_000, trainable=100_000_000, dtype_bytes=2,
                   kv_bytes_per_token=20_000, activation_bytes_per_token=60_000)
SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
         "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=2",
         "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
         "run.log=quiet", "run.report=false", "run.tensorboard=false", "run.threads=1",
         "filter.workers=0"]


def cfg_with(*overrides):
    return load_config(None, SMALL + list(overrides))


def test_the_fixed_part_is_the_count_by_hand():
    n = SHAPE.params
    # bf16 weights + fp32 masters; bf16 grads + fp32 master grads; AdamW's two fp32
    # moments; the engine's bf16 copy and its packed copy
    want = {"runtime": RUNTIME_BYTES, "weights": 2 * n + 4 * n, "gradients": 2 * n + 4 * n,
            "optimizer": 8 * n, "engine weights": 4 * n}
    assert fixed_bytes(cfg_with(), SHAPE) == want
    assert fixed_bytes(cfg_with("train.kl_coef=0.1"), SHAPE)["reference"] == 2 * n
    lora = ModelShape(**{**SHAPE.__dict__, "trainable": 1_000_000})
    assert fixed_bytes(cfg_with("train.lora.rank=8"), lora)["optimizer"] == 8_000_000


def test_a_budget_with_room_sizes_to_what_pays_and_nothing_else():
    """Any budget with room gives the same sizes, so the run's cuts and rounding are the same
    on every machine that can hold it."""
    plans = [plan_memory(cfg_with(f"run.memory_gib={g}"), SHAPE) for g in (8, 12, 64)]
    assert len({(p.kv_tokens, p.microbatch_tokens) for p in plans}) == 1
    p = plans[0]
    assert p.kv_tokens == step_kv_tokens(cfg_with()) and p.microbatch_tokens == AUTO_MAX_TOKENS
    assert not p.binds


@pytest.mark.parametrize("trim,keep", [(True, False), (False, False), (True, True)],
                         ids=["shared", "split", "kept-kv-split"])
def test_a_budget_that_binds_cuts_both_parts_within_it(trim, keep):
    """Kept answers (loop.carried_kv=keep) hold K/V through the update: the budget is split
    between the cache and the update even with run.trim_memory."""
    cfg = cfg_with(f"run.trim_memory={str(trim).lower()}", "generate.max_new_tokens=512",
                   "control.prompts_per_step=64",
                   f"loop.carried_kv={'keep' if keep else 'auto'}")
    trim = trim and not keep
    fixed = sum(fixed_bytes(cfg, SHAPE).values())
    budget = fixed + 0.1 * GIB
    plan = plan_memory(cfg.model_copy(update={"run": cfg.run.model_copy(
        update={"memory_gib": budget / GIB})}), SHAPE)
    assert plan.binds and plan.shared == trim
    kv = plan.kv_tokens * SHAPE.kv_bytes_per_token
    act = plan.microbatch_tokens * SHAPE.activation_bytes_per_token
    room = budget - fixed
    assert (max(kv, act) if trim else kv + act) <= room
    assert max(kv, act) > 0.45 * room  # the room is used, not left idle
    assert plan.kv_tokens < step_kv_tokens(cfg)


def test_a_budget_that_cannot_hold_the_model_says_what_it_holds_and_what_to_lower():
    with pytest.raises(ConfigError) as e:
        plan_memory(cfg_with("run.memory_gib=1.5"), SHAPE)
    msg = str(e.value)
    assert msg.startswith("run.memory_gib: 1.50 GiB cannot hold this run")
    assert "optimizer 0.75" in msg and "train.lora.rank=8" in msg
    assert "model.dtype=bfloat16" not in msg  # already bf16


def test_auto_takes_three_quarters_of_what_is_free(monkeypatch):
    monkeypatch.setattr(sizing, "memory_available", lambda: int(2.4 * GIB))
    with pytest.raises(ConfigError, match=r"run.memory_gib=auto .*: 1.80 GiB cannot hold"):
        plan_memory(cfg_with(), SHAPE)


def test_the_shape_from_the_config_is_the_built_models(tmp_path):
    from rollwise import models
    from rollwise.memory_budget import shape_of
    cfg = cfg_with("model.dtype=bfloat16")
    built, _ = models.build(cfg.model)
    assert shape_from_config(cfg) == shape_of(built, cfg)


@pytest.mark.integration
def test_a_run_records_its_planned_sizes_and_a_refused_one_leaves_nothing(tmp_path):
    refused = cfg_with(f"run.root={tmp_path}", "run.name=small", "run.memory_gib=0.3")
    with pytest.raises(ConfigError, match="cannot hold this run"):
        train(refused)
    assert not tmp_path.joinpath("small").exists()  # no run folder, no warm start
    assert not tmp_path.joinpath(".cache").exists()
    shape = shape_from_config(refused)
    room = 1024 * shape.activation_bytes_per_token  # a quarter of the usual micro-batch
    gib = (sum(fixed_bytes(refused, shape).values()) + room) / GIB
    cfg = cfg_with(f"run.root={tmp_path}", "run.name=fits", f"run.memory_gib={gib}")
    plan = plan_memory(cfg, shape)
    assert plan.binds and plan.microbatch_tokens == 1024  # cut to the budget
    train(cfg)
    recorded = yaml.safe_load((tmp_path / "fits" / "config.yaml").read_text())
    assert recorded["engine"]["kv_budget_tokens"] == plan.kv_tokens
    assert recorded["train"]["max_tokens_per_microbatch"] == plan.microbatch_tokens
