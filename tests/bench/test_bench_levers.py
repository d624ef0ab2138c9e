"""The levers bench's loss, attention and layer levers: each pair of arms computes the same values,
and both arms run."""

from __future__ import annotations

import copy

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


def test_the_compiled_layers_give_the_eager_pass_and_both_arms_step(tiny):
    model = copy.deepcopy(tiny[0])
    batch = packed_batch(model.config.vocab_size, 100, prompt=6, longest=20)
    arms, facts = layer_arms(model, batch)
    assert list(arms) == ["eager", "torch.compile"]
    assert facts["logprob_gap"] < 1e-5 and facts["compile_seconds"] > 0
    for once in arms.values():
        once()
    assert all(type(m).__name__ == "OptimizedModule" for m in model.get_decoder().layers)
