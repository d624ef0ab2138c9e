"""Verification: a payload for the wrong base version is refused and the engine left untouched;
a restarted engine, a corrupted payload, or weights changed behind the sync's back are caught
and repaired by a full sync (counted in the metrics); check mode catches what the checksum
is told not to look at. A stale or corrupt engine is never silent."""

import copy

import pytest
import torch

from rollwise.engine import BuiltinEngine
from rollwise.sync import (
    ChecksumError,
    CorruptPayloadError,
    StaleEngineError,
    WeightMismatchError,
    WeightSync,
)
from rollwise.sync.payload import bits, entry_views
from rollwise.sync.transport import InProcessTransport


class LMTrainer:
    """Trainer stand-in: AdamW steps on a language-model loss, `weights()` and `version` as
    rollwise.training.trainer.Trainer has them."""

    def __init__(self, model, lr=1e-3):
        self.model = copy.deepcopy(model)
        self.version = 0
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(0)

    def step(self):
        x = torch.randint(3, 30, (4, 10), generator=self.gen)
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.version += 1

    def weights(self):
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def setup(tiny, dtype=torch.bfloat16, lr=1e-3, **kw):
    model, tok = tiny
    trainer = LMTrainer(model, lr)
    engine = BuiltinEngine(trainer.model)
    engine.model.to(dtype)
    sync = WeightSync(trainer, InProcessTransport(engine), mode="sparse", **kw)
    return trainer, engine, sync


def engine_bits(engine):
    return {n: bits(t).clone() for n, t in engine.model.state_dict().items()}


def stray_write(engine, trainer, name):
    """Change one engine element that the trainer's next payload will not carry (its value in
    the trainer equals the engine's), as a bug or a second writer would."""
    ours = bits(trainer.weights()[name].to(torch.bfloat16)).reshape(-1)
    theirs = engine.model.state_dict()[name].view(-1)
    i = int((bits(theirs) == ours).nonzero()[0])
    with torch.no_grad():
        theirs[i] += 1.0


def assert_engine_is_trainer(engine, trainer):
    for n, t in engine.model.state_dict().items():
        ours = trainer.weights()[n].to(t.dtype)
        assert torch.equal(bits(t), bits(ours)), n


def test_wrong_base_version_is_refused_and_leaves_the_engine_untouched(tiny):
    trainer, engine, sync = setup(tiny)
    sync.push()  # first sync: full
    trainer.step()
    meta, arena = sync.sender.encode(trainer.weights(), trainer.version,
                                     sync.transport.alloc, full=False)
    assert meta.kind == "sparse" and meta.base_version == 0
    engine.version = 7  # say someone else loaded version 7
    before = engine_bits(engine)
    with pytest.raises(StaleEngineError, match="holds version 7.*applies to version 0.*full sync"):
        sync.transport.apply(meta, arena)
    assert engine.version == 7
    assert all(torch.equal(before[n], b) for n, b in engine_bits(engine).items())


def test_any_sender_holding_the_engines_weights_may_send_it_sparse_payloads(tiny):
    trainer, engine, sparse = setup(tiny, lr=1e-5)
    full = WeightSync(trainer, sparse.transport, mode="full")
    sparse.push()
    for _ in range(2):  # the base is named by content, not by who sent it
        trainer.step()
        assert sparse.push()["sync/sparse"] == 1.0
        assert full.push()["sync/sparse"] == 0.0
    assert sparse.totals["fallbacks"] == 0
    other = WeightSync(LMTrainer(tiny[0]), sparse.transport, mode="sparse")
    other.push()  # full: the engine now holds other weights ...
    engine.version = trainer.version  # ... under the version number the sparse base has
    trainer.step()
    m = sparse.push()
    assert m["sync/fallback_full"] == 1.0
    assert_engine_is_trainer(engine, trainer)


def test_push_falls_back_to_full_for_a_restarted_engine(tiny):
    trainer, engine, sync = setup(tiny)
    assert sync.push()["sync/sparse"] == 0.0  # a new engine gets a full payload
    trainer.step()
    assert sync.push()["sync/sparse"] == 1.0
    # restart: a fresh receiver (nothing verified yet) at the same version number
    sync.transport = InProcessTransport(engine)
    trainer.step()
    m = sync.push()
    assert m["sync/fallback_full"] == 1.0 and m["sync/sparse"] == 0.0
    assert engine.version == trainer.version == 2
    assert_engine_is_trainer(engine, trainer)
    trainer.step()
    m = sync.push()
    assert m["sync/sparse"] == 1.0 and m["sync/fallback_full"] == 0.0
    assert sync.totals["fallbacks"] == 1


@pytest.mark.parametrize("coding, refused", [
    ("delta", "differ from the trainer's"),  # a well-formed payload: the checksum sees it
    ("context", "differ from the trainer's|context-coded blob"),  # or the decoder does
])
def test_a_corrupted_payload_fails_its_checksum_and_marks_the_engine(tiny, coding, refused):
    trainer, engine, sync = setup(tiny, coding=coding)
    sync.push()
    trainer.step()
    meta, arena = sync.sender.encode(trainer.weights(), trainer.version,
                                     sync.transport.alloc, full=False)
    values, _ = next(iter(entry_views(meta, arena).values()))
    values.view(torch.int16)[0] ^= 1  # one flipped bit in transit
    with pytest.raises((ChecksumError, CorruptPayloadError), match=refused):
        sync.transport.apply(meta, arena)
    assert engine.version == -1  # no token will carry a version these weights do not have
    sync.sender.version = 1  # even a sender that believes the engine is current is refused
    meta, arena = sync.sender.encode(trainer.weights(), 2, sync.transport.alloc, full=False)
    with pytest.raises(StaleEngineError):
        sync.transport.apply(meta, arena)


def test_weights_changed_behind_the_syncs_back_are_repaired(tiny):
    trainer, engine, sync = setup(tiny, lr=1e-5)  # sparse tensors: the write stays unseen
    sync.push()
    trainer.step()
    sync.push()
    trainer.step()
    stray_write(engine, trainer, "model.layers.0.mlp.up_proj.weight")
    m = sync.push()  # sparse payload does not touch norm[3]; the checksum sees it
    assert m["sync/fallback_full"] == 1.0
    assert_engine_is_trainer(engine, trainer)


def test_check_mode_compares_every_weight(tiny):
    trainer, engine, sync = setup(tiny, lr=1e-5, with_checksum=False, check=True,
                                  coding="delta")
    sync.push()
    trainer.step()
    sync.push()  # passes: the engine equals the trainer
    trainer.step()
    stray_write(engine, trainer, "model.embed_tokens.weight")  # tied: lm_head too
    with pytest.raises(WeightMismatchError, match="model.embed_tokens.weight"):
        sync.push()


def test_a_stray_write_under_the_context_coding_is_refused_or_repaired(tiny):
    """The context coding decodes against the engine's own values, so a stray write there can
    also make the payload undecodable: then the sync falls back to a full payload, which
    repairs it. Either way the stray write does not go unseen."""
    trainer, engine, sync = setup(tiny, lr=1e-5, with_checksum=False, check=True,
                                  coding="context")
    sync.push()
    trainer.step()
    sync.push()
    trainer.step()
    stray_write(engine, trainer, "model.embed_tokens.weight")
    try:
        m = sync.push()
    except WeightMismatchError:
        return
    assert m["sync/fallback_full"] == 1.0
    assert_engine_is_trainer(engine, trainer)


def test_a_full_payload_missing_a_tensor_is_refused_before_any_write(tiny):
    trainer, engine, sync = setup(tiny)
    weights = trainer.weights()
    sync.sender.spec = {n: s for n, s in sync.sender.spec.items() if "norm" not in n}
    before = engine_bits(engine)
    with pytest.raises(CorruptPayloadError, match="lacks tensors"):
        sync._send(weights, 1, full=True)
    assert engine.version == 0
    assert all(torch.equal(before[n], b) for n, b in engine_bits(engine).items())


@pytest.mark.parametrize("coding", ["pairs", "delta"])
def test_an_index_out_of_range_is_refused(tiny, coding):
    trainer, engine, sync = setup(tiny, lr=1e-5, coding=coding)
    sync.push()
    trainer.step()
    meta, arena = sync.sender.encode(trainer.weights(), 1, sync.transport.alloc, full=False)
    views = entry_views(meta, arena)
    if coding == "pairs":
        sparse = [i for v, i in views.values() if i is not None]
        assert sparse, "an AdamW step at lr 1e-5 leaves bf16 tensors below break-even"
        sparse[0][-1] = 10**8
    else:  # every short gap made 255: the indices run past the tensor's end
        coded = [e for e in meta.entries if e.coded and e.coded.changes > 300]
        assert coded, "an AdamW step at lr 1e-5 leaves no coded tensor with 300 changes"
        gaps = views[coded[0].name][0][:coded[0].coded.changes]
        gaps[gaps != 0] = 255
    with pytest.raises(CorruptPayloadError, match="IndexError|out of bounds|index"):
        sync.transport.apply(meta, arena)
    assert engine.version == -1


def test_build_sync_refuses_an_engine_that_does_not_match_the_config(tiny):
    from rollwise.config import Config
    from rollwise.engine.backends import build_engine
    from rollwise.sync import build_sync
    model, tok = tiny
    trainer = LMTrainer(model)
    cfg = Config.model_validate({"sync": {"mode": "sparse", "engine_dtype": "bfloat16"}})
    engine = build_engine(cfg, trainer.model)
    assert engine.model.model.norm.weight.dtype == torch.bfloat16
    sync = build_sync(cfg.sync, trainer, engine)
    trainer.step()
    assert sync.push()["sync/bytes"] > 0 and engine.version == 1
    with pytest.raises(ValueError, match="sync.transport=process.*build_engine"):
        build_sync(cfg.sync.model_copy(update={"transport": "process"}), trainer, engine)
    fp32 = BuiltinEngine(trainer.model)
    with pytest.raises(ValueError, match="engine_dtype=bfloat16.*float32"):
        build_sync(cfg.sync, trainer, fp32)
