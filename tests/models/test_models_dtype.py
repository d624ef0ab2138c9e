"""Loading a model in a lower precision: the same model transformers' own loading in that
dtype gives, and, for training, the float32 values the cast rounded away."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollwise import models
from rollwise.config import ModelConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model, tok = models.build(ModelConfig(arch="llama", hidden_size=32, num_layers=2,
                                          num_heads=2, num_kv_heads=1, intermediate_size=64),
                              seed=0)
    path = tmp_path_factory.mktemp("m") / "init"
    models.save(model, tok, path)
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_load_is_transformers_own_load_in_that_dtype(folder, dtype):
    ours, _ = models.load_model(folder, dtype, for_training=True)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=models.DTYPES[dtype])
    assert ours.dtype == models.DTYPES[dtype]
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    rotary = dict(ours.named_buffers())["model.rotary_emb.inv_freq"]
    assert rotary.dtype == torch.float32  # not saved: kept as computed, as transformers does
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    full = models.take_full_precision(ours)
    saved = AutoModelForCausalLM.from_pretrained(folder)  # float32, as saved
    assert full is not None and set(full) == {n for n, _ in saved.named_parameters()}
    assert all(torch.equal(full[n], p) for n, p in saved.named_parameters())


def test_nothing_is_kept_unless_for_training(folder):
    model, _ = models.load_model(folder, "bfloat16")
    assert models.take_full_precision(model) is None
    model, _ = models.load_model(folder, "float32", for_training=True)  # nothing was rounded
    assert models.take_full_precision(model) is None
