"""train.max_tokens_per_microbatch = "auto": the token budget from the model's shape and the
device's memory. The activation estimate bounds what autograd really keeps; the budget moves
with memory, checkpointing and a reference copy as its closed form says; a trainer on a small
machine cuts its passes to fit, and a setting overrides it."""

import copy

import pytest
import torch
from train_helpers import clone, make_groups

from rollwise.config import TrainConfig
from rollwise.training import microbatch
from rollwise.training.microbatch import (
    activation_bytes_per_token,
    auto_token_budget,
    state_bytes,
)
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch


def saved_bytes(model, batch: Batch) -> int:
    """Bytes autograd keeps for the backward pass of one forward, each storage once."""
    storages: dict[int, int] = {}

    def keep(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        token_logprobs(model, batch, chunk=16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_estimate_bounds_what_autograd_keeps(tiny, dtype, checkpointing):
    """Without checkpointing: at least what autograd's saved tensors hold per token of a real
    forward pass (each storage once, weights excluded), at most 1.5 times it."""
    from rollwise.training.trainer import enable_checkpointing
    model, tok = tiny
    model = copy.deepcopy(model).to(dtype).train()
    if checkpointing:
        enable_checkpointing(model)
    groups = make_groups(tiny[0], tok, n_prompts=4, group_size=4, max_new_tokens=8, seed=1)
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    per_token = saved_bytes(model, batch) / batch.input_ids.numel()
    estimate = activation_bytes_per_token(model.config, dtype.itemsize, checkpointing)
    assert per_token <= estimate
    if checkpointing:  # the estimate adds the layer recomputed in the backward pass, which
        # no forward keeps: it is bounded by the layers' input alone plus a whole layer
        assert estimate < activation_bytes_per_token(model.config, dtype.itemsize, False)
    else:
        assert estimate <= 1.5 * per_token  # an upper estimate, not a wild one


def test_state_bytes_count_weights_gradients_masters_and_moments():
    model = torch.nn.Linear(10, 3)  # 33 parameters
    assert state_bytes(model, reference=False) == 33 * 4 * 2 + 33 * 4 * 2
    assert state_bytes(model.bfloat16(), reference=True) == 33 * 2 * 3 + 33 * 4 * 4
    model.weight.requires_grad_(False)  # only the bias trains (as adapters alone do)
    assert state_bytes(model, reference=False) == 33 * 2 + 3 * 2 + 3 * 4 * 4


def test_the_budget_follows_memory_checkpointing_and_the_reference(tiny, monkeypatch):
    model = tiny[0]
    assert auto_token_budget(model, checkpointing=False, reference=False,
                             memory=2 ** 40) == microbatch.AUTO_MAX_TOKENS  # a CPU's cap
    monkeypatch.setattr(microbatch, "AUTO_MAX_TOKENS", 10 ** 12)  # the formula below it
    per = activation_bytes_per_token(model.config, 4, False)
    base = auto_token_budget(model, checkpointing=False, reference=False, memory=2 ** 32)
    more = auto_token_budget(model, checkpointing=False, reference=False, memory=2 ** 33)
    assert more - base == pytest.approx(0.5 * 2 ** 32 / per, abs=1)
    assert auto_token_budget(model, checkpointing=True, reference=False, memory=2 ** 32) > base
    weights = sum(p.numel() * 4 for p in model.parameters())
    with_ref = auto_token_budget(model, checkpointing=False, reference=True, memory=2 ** 32)
    assert base - with_ref == pytest.approx(weights / per, abs=1)
    assert auto_token_budget(model, checkpointing=False, reference=False,
                             memory=1) == microbatch.MIN_TOKENS


def test_a_trainer_on_a_small_machine_cuts_its_passes_and_a_setting_overrides(tiny,
                                                                              monkeypatch):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=4, group_size=4, max_new_tokens=8, seed=2)
    monkeypatch.setattr(microbatch, "MIN_TOKENS", 1)
    per = activation_bytes_per_token(model.config, 4, False)
    states = state_bytes(model, reference=False)
    monkeypatch.setattr(microbatch, "device_memory", lambda device: 2 * (states + 40 * per))
    trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1), pad_id=tok.pad_token_id)
    assert trainer.token_budget == 40
    shapes = []
    trainer.model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(kwargs["input_ids"].shape), with_kwargs=True)
    trainer.update(clone(groups))
    assert len(shapes) > 2 and max(r * n for r, n in shapes if r > 1) <= 40
    assert Trainer(copy.deepcopy(model), TrainConfig(max_tokens_per_microbatch=999),
                   pad_id=0).token_budget == 999
    assert Trainer(copy.deepcopy(model), TrainConfig(max_tokens_per_microbatch=None),
                   pad_id=0).token_budget is None


def test_the_device_memory_is_the_machines_within_its_container(tmp_path, monkeypatch):
    import os
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, unlimited = tmp_path / "memory.max", tmp_path / "unlimited"
    limit.write_text(f"{2 ** 30}\n")
    unlimited.write_text("max\n")
    cpu = torch.device("cpu")
    monkeypatch.setattr(microbatch, "CGROUP_LIMITS", (str(unlimited), str(tmp_path / "none")))
    assert microbatch.device_memory(cpu) == total
    monkeypatch.setattr(microbatch, "CGROUP_LIMITS", (str(unlimited), str(limit)))
    assert microbatch.device_memory(cpu) == min(total, 2 ** 30)
