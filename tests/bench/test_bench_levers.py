"""The levers bench's loss, attention and layer levers: each pair of arms computes the same values,
and both arms run."""

from __future__ import annotations

import copy

import torch

from rollwise.bench.levers import attention_arms, layer_arms, loss_arms, packed_batch


def test_the_compiled_loss_equals_the_eager_one_and_both_arms_step():
    arms, facts = loss_arms(256)
    assert facts["tokens"] == 256 and facts["compile_seconds"] > 0
    assert facts["loss_gap"] < 1e-6
    assert list(arms) == ["eager", "torch.compile"]
    for once in arms.values():
        once()  # forward and backward, as the bench times them


def test_the_attention_arms_agree_and_segments_compute_fewer_scores(tiny):
    model = copy.deepcopy(tiny[0])
    batch = packed_batch(model.config.vocab_size, 600, prompt=20, longest=60)
    assert batch.size % 8 == 0 and int(batch.loss_mask.sum()) >= 600
    arms, facts = attention_arms(model, batch)
    assert list(arms) == ["dense mask", "segments"]
    assert facts["logprob_gap"] < 1e-5
    assert facts["segment_scores"] < facts["dense_scores"]
    for once in arms.values():
        once()


def test_the_compiled_layers_give_the_eager_pass_over_changing_shapes(tiny):
    model = copy.deepcopy(tiny[0])
    batches = [packed_batch(model.config.vocab_size, 100, prompt=6, longest=n, seed=s)
               for s, n in ((0, 20), (1, 40))]
    assert batches[0].loss_mask.shape != batches[1].loss_mask.shape
    arms, facts = layer_arms(model, batches)
    assert list(arms) == ["eager", "torch.compile"]
    assert facts["batches"] == 2 and facts["graphs_compiled"] >= 1
    assert facts["logprob_gap"] < 1e-5 and facts["first_round_seconds"] > 0
    # the tiny model is float32: both arms are their own float32 reference
    assert facts["eager_vs_fp32"] < 1e-6 and facts["compiled_vs_fp32"] < 1e-5
    for once in arms.values():
        assert len(once()) == 2
    assert all(type(m).__name__ == "OptimizedModule" for m in model.get_decoder().layers)


def test_compiled_block_parts_give_the_eager_pass_with_one_graph_for_every_layout(tiny):
    model = copy.deepcopy(tiny[0])
    batches = [packed_batch(model.config.vocab_size, 100, prompt=6, longest=n, seed=s)
               for s, n in ((0, 20), (1, 40), (2, 30), (3, 50))]
    arms, facts = layer_arms(model, batches, part="parts")
    assert facts["logprob_gap"] < 1e-5 and facts["compiled_vs_fp32"] < 1e-5
    assert 1 <= facts["graphs_compiled"] <= 4  # forward graphs of the norms and MLP, no more
    assert all(type(m).__name__ != "OptimizedModule" for m in model.get_decoder().layers)
    for once in arms.values():
        assert len(once()) == 4


def test_the_float32_reference_sees_a_bf16_models_rounding(tiny):
    model = copy.deepcopy(tiny[0]).to(torch.bfloat16)
    batch = packed_batch(model.config.vocab_size, 100, prompt=6, longest=20)
    _, facts = layer_arms(model, [batch])
    assert facts["eager_vs_fp32"] > 1e-4  # bf16 against float32, computed apart
    assert facts["logprob_gap"] < 0.5
