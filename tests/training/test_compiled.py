"""train.compile_blocks: each block's norms and MLP compiled in place give the eager update,
keep the parameters' names, and leave the attention (which reads the packed layout) eager."""

from __future__ import annotations

import copy

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups

from rollwise.config import TrainConfig
from rollwise.training.compiled import blocks, compile_block_parts
from rollwise.training.trainer import Trainer


@pytest.mark.parametrize("train", [{"gradient_checkpointing": True},
                                   {"lora": {"rank": 4, "targets": "all-linear"}}])
def test_compiled_block_parts_give_the_eager_update(tiny, train):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=4, group_size=4, max_new_tokens=6, seed=3)
    grads, names = [], []
    for compiled in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2, warmup_steps=0,
                                                            compile_blocks=compiled, **train),
                          pad_id=tok.pad_token_id, seed=2)
        seen = capture_grads(trainer)
        trainer.update(clone(groups))
        grads.append([torch.cat([g.flatten() for g in step]) for step in seen])
        names.append(list(trainer.model.state_dict()))
    assert names[0] == names[1]
    assert len(grads[0]) == len(grads[1]) == 2
    for a, b in zip(*grads):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_only_the_parts_that_never_see_the_layout_are_compiled(tiny):
    model = copy.deepcopy(tiny[0])
    layers = blocks(model)
    children = sum(1 for b in layers for _ in b.children())
    done = compile_block_parts(model)
    assert done == children - len(layers)  # all but one attention module a block
    for block in layers:
        for name, child in block.named_children():
            compiled = getattr(child, "_compiled_call_impl", None) is not None
            assert compiled is (name != "self_attn")
    assert compile_block_parts(model) == 0  # idempotent


def test_a_model_without_known_blocks_warns_and_runs_eager(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    model.model.renamed = model.model.layers  # blocks under a name compile_block_parts
    del model.model.layers                    # does not know
    assert blocks(model) == []
    with pytest.warns(RuntimeWarning, match="train.compile_blocks: no decoder blocks"):
        Trainer(model, TrainConfig(compile_blocks=True), pad_id=tok.pad_token_id)
