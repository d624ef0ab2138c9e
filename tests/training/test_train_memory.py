"""Memory and precision options of the trainer: token-budget micro-batches, gradient
checkpointing and bf16 parameters with fp32 master weights, each against the plain update."""

import copy

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups

from rollwise.config import SyncConfig, TrainConfig
from rollwise.engine import BuiltinEngine
from rollwise.store import checkpoint as ckpt
from rollwise.sync import build_sync
from rollwise.training.trainer import Trainer


@pytest.fixture(scope="module")
def groups(tiny):
    model, tok = tiny
    return make_groups(model, tok, n_prompts=3, group_size=4, max_new_tokens=8, seed=5)


def forward_shapes(model) -> list[tuple[int, int]]:
    shapes = []
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True)
    return shapes


def one_update(model, tok, groups, **cfg):
    trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, **cfg),
                      pad_id=tok.pad_token_id)
    seen, shapes = capture_grads(trainer), forward_shapes(trainer.model)
    metrics = trainer.update(clone(groups))
    return torch.cat([g.flatten() for g in seen[0]]), metrics, shapes


@pytest.mark.parametrize("pack", [True, False])
def test_token_budget_micro_batches_give_the_gradient_of_one_batch(tiny, groups, pack):
    model, tok = tiny
    whole, m_whole, _ = one_update(model, tok, groups, pack_prompts=pack)
    budget = 40  # a few rows of prompt + response per pass
    cut, m_cut, shapes = one_update(model, tok, groups, pack_prompts=pack,
                                    max_tokens_per_microbatch=budget)
    assert whole.abs().max() > 0
    assert (cut - whole).abs().max() <= 1e-5 * whole.abs().max()  # float rounding only
    assert m_cut["train/loss"] == pytest.approx(m_whole["train/loss"], rel=1e-5, abs=1e-7)
    if not pack:  # padded passes: every pass holds at most the budget (or one long row)
        assert len(shapes) > 2 and all(r * t <= budget or r == 1 for r, t in shapes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_gives_the_same_gradient(tiny, groups, dtype):
    """The recomputed forward is the stored one, in bf16 too (the real model's CPU default)."""
    from rollwise import models
    model, tok = tiny
    model = models.to_dtype(copy.deepcopy(model), dtype)
    plain, m_plain, _ = one_update(model, tok, groups)
    ckpt_grad, m_ckpt, _ = one_update(model, tok, groups, gradient_checkpointing=True)
    trainer = Trainer(copy.deepcopy(model), TrainConfig(gradient_checkpointing=True),
                      pad_id=tok.pad_token_id)
    assert trainer.model.is_activation_checkpointing  # it is on, so the equality means something
    assert plain.abs().max() > 0
    assert (ckpt_grad - plain).abs().max() <= 1e-5 * plain.abs().max()
    assert m_ckpt["train/loss"] == pytest.approx(m_plain["train/loss"], rel=1e-5)


def test_bf16_parameters_train_on_fp32_master_weights_and_the_engine_gets_their_cast(
        tiny, groups):
    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    trainer = Trainer(bf16, TrainConfig(lr=1e-4, minibatches=2), pad_id=tok.pad_token_id)
    assert trainer.master is not None
    engine = BuiltinEngine(trainer.model, seed=0)
    sync = build_sync(SyncConfig(mode="sparse"), trainer, engine)
    start = [m.detach().clone() for m in trainer.master.params()]
    for _ in range(2):
        trainer.update(clone(groups))
        sync.push()
    masters = trainer.master.params()
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values()
               for s in st.values() if torch.is_tensor(s) and s.dim() > 0)
    params = dict(trainer.model.named_parameters())
    engine_weights = dict(engine.model.named_parameters())
    for (name, p), m in zip(params.items(), masters):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the master's cast
        assert torch.equal(engine_weights[name], m.to(torch.bfloat16))  # and so does the engine
    # lr 1e-4 moves weights by less than bf16 resolves: the master keeps what the cast drops
    moved = torch.cat([(m - s).flatten() for m, s in zip(masters, start)])
    assert moved.abs().max() > 0
    hidden = torch.cat([(m - m.to(torch.bfloat16).float()).flatten() for m in masters])
    assert hidden.abs().max() > 0


def test_master_weights_survive_a_checkpoint(tiny, groups):
    model, tok = tiny
    a = Trainer(copy.deepcopy(model).to(torch.bfloat16), TrainConfig(lr=1e-4),
                pad_id=tok.pad_token_id)
    a.update(clone(groups))
    state = copy.deepcopy(ckpt.trainer_state(a))
    b = Trainer(copy.deepcopy(model).to(torch.bfloat16), TrainConfig(lr=1e-4),
                pad_id=tok.pad_token_id)
    ckpt.set_trainer_state(b, state)
    assert all(torch.equal(x, y) for x, y in zip(a.master.params(), b.master.params()))
    a.update(clone(groups))
    b.update(clone(groups))
    assert all(torch.equal(x, y) for x, y in zip(a.master.params(), b.master.params()))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors])


def policy_follows_master(trainer, groups) -> float:
    """The slope of the policy's (the bf16 cast's) movement on the master's over one update:
    1 when the cast moves with the master on average, near 0 when rounding holds it still."""
    cast, master = flat(trainer.model.parameters()), flat(trainer.master.params())
    trainer.update(clone(groups))
    d_cast = flat(trainer.model.parameters()) - cast
    d_master = flat(trainer.master.params()) - master
    return ((d_cast * d_master).sum() / (d_master * d_master).sum()).item()


def test_bf16_masters_start_from_the_float32_values_the_model_was_cast_from(tiny, groups):
    """Started from the bf16 cast, every master sits on the bf16 grid and an update smaller
    than half a grid step moves no weight of the policy; started from the float32 values it
    was cast from, the cast follows the master from the first step."""
    from rollwise import models
    model, tok = tiny
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = 1e-5  # Adam's first step moves each weight by about lr: under half a bf16 step here

    kept = models.to_dtype(copy.deepcopy(model), "bfloat16", for_training=True)
    a = Trainer(kept, TrainConfig(lr=lr, minibatches=1), pad_id=tok.pad_token_id)
    assert models.take_full_precision(kept) is None  # handed over once, to the trainer
    for (name, p), m in zip(a.model.named_parameters(), a.master.params()):
        assert torch.equal(m, full[name])  # the float32 values, not their cast
        assert torch.equal(p, m.to(torch.bfloat16))  # and the model holds their cast

    cast = models.to_dtype(copy.deepcopy(model), "bfloat16")  # nothing kept
    b = Trainer(cast, TrainConfig(lr=lr, minibatches=1), pad_id=tok.pad_token_id)
    assert all(torch.equal(m, m.to(torch.bfloat16).float()) for m in b.master.params())

    assert torch.equal(flat(a.model.parameters()), flat(b.model.parameters()))  # same policy
    assert 0.8 < policy_follows_master(a, groups) < 1.25  # measured 1.005
    assert policy_follows_master(b, groups) < 0.2  # measured 0.057
    for p, m in zip(a.model.parameters(), a.master.params()):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_full_precision_values_that_no_longer_match_the_model_are_not_used(tiny):
    from rollwise import models
    from rollwise.training.precision import MasterWeights
    model, _ = tiny
    low = models.to_dtype(copy.deepcopy(model), "bfloat16", for_training=True)
    first = next(low.parameters())
    with torch.no_grad():
        first.add_(1.0)  # changed after the cast: its kept float32 value is stale
    master = MasterWeights.of(low)
    assert all(torch.equal(p, m.to(torch.bfloat16))
               for p, m in zip(low.parameters(), master.params()))
    full = [p.detach() for p in model.parameters()]
    assert not torch.equal(master.params()[0], full[0])  # the stale one: from the model
    assert all(torch.equal(m, f) for m, f in zip(master.params()[1:], full[1:]))  # the rest
    assert models.take_full_precision(models.to_dtype(copy.deepcopy(model), "bfloat16")) is None


def test_a_bf16_run_from_a_float32_folder_starts_its_masters_from_the_folder(tmp_path):
    from rollwise import models
    from rollwise.config import ModelConfig, load_config
    from rollwise.loop.run import Run
    from rollwise.report.progress import Progress
    model, tok = models.build(ModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=1, intermediate_size=64), seed=0)
    models.save(model, tok, tmp_path / "init")
    cfg = load_config(None, [f"model.path={tmp_path / 'init'}", "model.dtype=bfloat16",
                             "task.eval_size=4", f"run.root={tmp_path}", "run.log=quiet"])
    with Run(cfg, Progress("quiet", 1)) as run:
        saved = dict(model.named_parameters())
        names = [n for n, _ in run.trainer.model.named_parameters()]
        assert run.trainer.model.dtype == torch.bfloat16
        assert all(torch.equal(m, saved[n]) for n, m in zip(names, run.trainer.master.params()))


def loop_adamw_update(model, tok, groups, updates: int, monkeypatch):
    """The same updates with AdamW's per-tensor loop and per-tensor master copies."""
    from rollwise.training import precision, trainer
    with monkeypatch.context() as m:
        m.setattr(trainer, "adamw_kernel", lambda params: {"foreach": False, "fused": False})
        m.setattr(precision, "_foreach_copy",
                  lambda dst, src: [d.copy_(s) for d, s in zip(dst, src)])
        t = Trainer(model, TrainConfig(lr=1e-3, minibatches=2), pad_id=tok.pad_token_id)
        assert t.optimizer.defaults["foreach"] is False and not t.optimizer.defaults["fused"]
        for _ in range(updates):
            t.update(clone(groups))
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_optimizer_and_foreach_master_copies_step_as_the_per_tensor_loop(
        tiny, groups, dtype, monkeypatch):
    """Three updates (six AdamW steps) through torch's fused AdamW and foreach copies land on
    the parameters (bf16: the masters) and moments of the per-tensor loop, up to float
    rounding (1e-4 of the distance six steps can move a weight); the masters' gradient
    buffers are reused, not reallocated."""
    model, tok = tiny
    fast = Trainer(copy.deepcopy(model).to(dtype), TrainConfig(lr=1e-3, minibatches=2,
                                                               release_grads=False),
                   pad_id=tok.pad_token_id)
    assert fast.optimizer.defaults["fused"] is True
    buffers = None
    for _ in range(3):
        fast.update(clone(groups))
        if fast.master:
            now = [m.grad.data_ptr() for m in fast.master.params()]
            assert buffers in (None, now)
            buffers = now
    slow = loop_adamw_update(copy.deepcopy(model).to(dtype), tok, groups, 3, monkeypatch)
    for a, b in zip(fast.params(), slow.params()):
        # AdamW moves a weight by about lr a step: float rounding is far below that, a wrong
        # step (bias correction, decay, a missed tensor) is not
        assert a.dtype == torch.float32 and (a - b).abs().max() <= 1e-4 * 1e-3 * 6
    for p, m in fast.master.pairs if fast.master else ():
        assert torch.equal(p, m.to(p.dtype))  # the model holds the masters' cast
    states = [(fast.optimizer.state[a], slow.optimizer.state[b])
              for a, b in zip(fast.params(), slow.params())]
    for sa, sb in states:
        for key in ("exp_avg", "exp_avg_sq"):
            assert (sa[key] - sb[key]).abs().max() <= 1e-4 * sb[key].abs().max()


def test_a_parameter_without_a_gradient_gets_a_zero_master_gradient():
    from rollwise.training.precision import MasterWeights
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).bfloat16()
    master = MasterWeights.of(model)
    for step in range(2):
        model[0](torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()  # model[1] unused
        master.grads_to_master()
        grads = [m.grad for m in master.params()]
        assert all(p.grad is None for p in model.parameters())
        assert torch.equal(grads[0], model[0].weight.new_ones(3, 4).float())
        assert not grads[2].any() and not grads[3].any()
        if step == 0:
            grads[2].fill_(7.0)  # a stale value from an earlier step is not kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_released_gradients_leave_nothing_between_updates_and_change_nothing(tiny, groups,
                                                                             dtype):
    """train.release_grads: no gradient (nor fp32 master gradient) lives between updates, and
    three updates end on the weights and metrics of the buffers kept."""
    from rollwise import models
    model, tok = tiny
    model = models.to_dtype(copy.deepcopy(model), dtype, for_training=True)
    runs = {}
    for release in (True, False):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2, release_grads=release),
                          pad_id=tok.pad_token_id)
        metrics = [trainer.update(clone(groups)) for _ in range(3)]
        held = [p for p in trainer.params() + list(trainer.model.parameters())
                if p.grad is not None]
        runs[release] = (trainer, metrics, held)
    assert runs[True][2] == [] and runs[False][2] != []
    assert runs[True][1] == runs[False][1]
    for p, q in zip(runs[True][0].params(), runs[False][0].params()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_reduced_without_gradient_a_few_tokens_at_a_time_match_the_whole_reduction(
        dtype):
    """The no-gradient reduction (the fast paths' check, the full-logit passes without the
    chunked head) goes a few tokens at a time, so its fp32 temporaries stay small; each
    position's log-softmax is the one over the whole tensor."""
    from rollwise.training.head import chunk_tokens
    from rollwise.training.trainer import _from_logits
    torch.manual_seed(0)
    V = 1 << 17  # chunk_tokens(V) = 48 positions: each row's 100 here span three chunks
    logits, ids = (torch.randn(2, 101, V) * 4).to(dtype), torch.randint(0, V, (2, 101))
    assert 2 * chunk_tokens(V) < 100 < 3 * chunk_tokens(V)
    whole = logits[:, :-1].float().log_softmax(-1)
    want_logp = whole.gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_ent = -(whole.exp() * whole).sum(-1)
    with torch.no_grad():
        logp, ent = _from_logits(logits, ids, entropy_grad=False)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    grad = logits.float().requires_grad_()  # with a gradient: the whole reduction, as before
    logp_g, _ = _from_logits(grad, ids, entropy_grad=False)
    assert logp_g.requires_grad
    torch.testing.assert_close(logp_g.detach(), want_logp, rtol=0, atol=1e-6)


def test_free_pages_go_back_before_each_micro_batch_and_change_nothing(tiny, groups,
                                                                         monkeypatch):
    """train.trim_microbatches: on a CPU the allocator's free pages are given back before
    each micro-batch (one call each), and the gradient is that of the update without it."""
    import rollwise.training.trainer as trainer_module
    model, tok = tiny
    calls = []
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: calls.append(1))
    grads, counts = {}, {}
    for trim in (True, False):
        calls.clear()
        grads[trim], _, _ = one_update(model, tok, groups, trim_microbatches=trim,
                                       max_tokens_per_microbatch=24, pack_prompts=False)
        counts[trim] = len(calls)
    assert counts[True] > 2 and counts[False] == 0
    assert torch.equal(grads[True], grads[False])
