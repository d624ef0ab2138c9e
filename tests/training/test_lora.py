"""LoRA training (train.lora): adapters only in the optimizer, the checkpoint and the weight
sync; the engine's merged weights against peft's own merge; the KL reference with the
adapters disabled against the base model."""

from __future__ import annotations

import copy

import pytest
import torch
from train_helpers import PROMPTS, make_groups

from rollwise.config import SyncConfig, TrainConfig
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.engine.base import Engine
from rollwise.sync import build_sync
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch

LORA = {"rank": 4, "targets": "all-linear"}


def lora_trainer(tiny, **train):
    model, tok = tiny
    base = copy.deepcopy(model)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, lora=LORA, **train)
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    return trainer, base, tok


def randomize_adapters(trainer, seed=0):
    """peft starts B at 0 (no change); random B makes the adapters matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def greedy(engine, tok, n=4):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    reqs = [Request(tok(p)["input_ids"], params, i) for i, p in enumerate(PROMPTS[:n])]
    return engine.generate(reqs)


def test_only_the_adapters_are_optimized_checkpointed_and_sent(tiny):
    trainer, base, tok = lora_trainer(tiny)
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert sum(p.numel() for p in trainer.params()) == sum(
        p.numel() for p in trainer.model.parameters() if p.requires_grad)
    state = trainer.state_dict()
    assert state["model"] and all("lora_" in k for k in state["model"])
    sent = trainer.weights()
    assert set(sent) == set(trainer.adapters.shapes())
    assert all(k.endswith((".lora_A", ".lora_B")) for k in sent)
    engine = BuiltinEngine(base)
    sync = build_sync(SyncConfig(), trainer, engine)
    assert set(sync.transport.state().spec) == set(sent)  # the engine exposes the adapters
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    m = sync.push()
    assert m["sync/full_bytes"] == adapter_bytes
    assert adapter_bytes < m["sync/bytes"] < adapter_bytes + 8192  # adapters and metadata
    model_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    assert m["sync/bytes"] < model_bytes / 3


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_the_engine_after_an_adapter_sync_equals_one_built_from_the_merged_model(tiny, mode):
    trainer, base, tok = lora_trainer(tiny)
    engine = BuiltinEngine(base)
    sync = build_sync(SyncConfig(mode=mode, check=True), trainer, engine)
    sync.push()
    before = greedy(engine, tok)
    assert [c.token_ids for c in before] == [c.token_ids for c in greedy(BuiltinEngine(base),
                                                                         tok)]
    randomize_adapters(trainer)
    sync.push()  # check=True: the engine's adapters equal the trainer's bit for bit
    groups = make_groups(engine.model, tok, seed=1, version=trainer.version)
    trainer.update(groups)  # a real step moves them too
    sync.push()
    merged = copy.deepcopy(trainer.model).merge_and_unload()  # peft's own merge
    for name, w in merged.state_dict().items():
        assert torch.equal(w, engine.model.state_dict()[name]), name  # bit for bit in fp32
    ours, fresh = greedy(engine, tok), greedy(BuiltinEngine(merged), tok)
    assert [c.token_ids for c in ours] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in ours] != [c.token_ids for c in before]  # the adapters count
    for a, b in zip(ours, fresh):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_behaviour_logprobs_match_the_trainers_unmerged_forward(tiny):
    """The engine runs merged weights, the trainer x W0 + scale x A B: the same function up
    to float rounding, well within train.old_logprobs_tolerance."""
    trainer, base, tok = lora_trainer(tiny)
    engine = BuiltinEngine(base)
    sync = build_sync(SyncConfig(), trainer, engine)
    randomize_adapters(trainer, seed=3)
    sync.push()
    groups = make_groups(engine.model, tok, seed=2)
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        logp = token_logprobs(trainer.model.eval(), batch)[0]
    gap = max(abs(logp[i, len(s.prompt_ids) - 1 + j] - s.logprobs[j])
              for i, s in enumerate(samples) for j in range(s.num_tokens))
    assert gap < TrainConfig().old_logprobs_tolerance


def test_the_kl_reference_is_the_base_model_with_the_adapters_disabled(tiny):
    trainer, base, tok = lora_trainer(tiny, kl_coef=0.1)
    assert trainer.ref_model is None  # no second copy of the weights
    randomize_adapters(trainer, seed=4)
    groups = make_groups(base, tok, seed=3)
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        ref = trainer.reference_logprobs(batch)
        expected = token_logprobs(base.eval(), batch)[0]
        policy = token_logprobs(trainer.model, batch)[0]
    mask = batch.loss_mask > 0  # packed passes compute the response positions only
    assert torch.allclose(ref[mask], expected[mask], atol=1e-6)
    assert not torch.allclose(policy[mask], expected[mask], atol=1e-3)  # adapters on otherwise
    m = trainer.update(groups)  # the KL term trains through the same reference
    assert m["train/kl_ref"] > 0


def test_a_checkpoint_restores_the_adapters_and_refuses_another_base(tiny):
    trainer, base, tok = lora_trainer(tiny)
    randomize_adapters(trainer, seed=5)
    trainer.update(make_groups(base, tok, seed=4))
    state = copy.deepcopy(trainer.state_dict())
    other, _, _ = lora_trainer(tiny)
    other.load_state_dict(state)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(p, q), n
    groups = make_groups(base, tok, seed=5)
    assert trainer.update(copy.deepcopy(groups)) == other.update(groups)  # the optimizer too
    moved = copy.deepcopy(tiny[0])
    with torch.no_grad():
        next(moved.parameters()).add_(1e-3)
    on_other_base = Trainer(moved, TrainConfig(lr=1e-2, warmup_steps=0, lora=LORA),
                            pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="other base weights"):
        on_other_base.load_state_dict(state)
    full = Trainer(copy.deepcopy(tiny[0]), TrainConfig(), pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="train.lora"):
        full.load_state_dict(state)


def test_an_engine_without_adapters_is_refused_by_name(tiny):
    trainer, base, tok = lora_trainer(tiny)

    class Plain(Engine):
        def add(self, request):
            return 0

        def step(self):
            return []

        def has_unfinished(self):
            return False

    with pytest.raises(NotImplementedError, match="Plain cannot apply LoRA"):
        build_sync(SyncConfig(), trainer, Plain())


def test_bad_lora_settings_are_refused_before_any_work(tiny):
    from rollwise.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="world_size"):
        load_config(None, ["train.lora.rank=8", "train.world_size=2"])
    with pytest.raises(ValueError, match=r"train.lora.targets=\['nope'\]"):
        Trainer(copy.deepcopy(tiny[0]), TrainConfig(lora={"rank": 2, "targets": ["nope"]}),
                pad_id=0)
