"""The trainer end to end on real samples: gradient-accumulation invariance, every named
choice runs and stays finite, KL and entropy terms act in the right direction, presets load."""

import copy
from pathlib import Path

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups, set_on_policy

from rollwise import registry
from rollwise.config import CorrectionConfig, TrainConfig, load_config
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def groups(tiny):
    model, tok = tiny
    return make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)


@pytest.mark.parametrize("loss, agg", [
    ("ppo_clip", "seq-mean-token-mean"), ("ppo_clip", "token-mean"),
    ("dual_clip", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean")])
def test_gradient_accumulation_8x1_equals_1x8(tiny, groups, loss, agg):
    model, tok = tiny
    grads, losses = [], []
    for micro in (1, 0):  # 8 micro-batches of 1 sample, then one of 8
        cfg = TrainConfig(loss=loss, loss_agg=agg, minibatches=1, micro_batch_size=micro,
                          entropy_coef=0.01, kl_coef=0.05, clip_low=0.2, clip_high=0.28)
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
        seen = capture_grads(trainer)
        losses.append(trainer.update(clone(groups))["train/loss"])
        assert len(seen) == 1
        grads.append(torch.cat([g.flatten() for g in seen[0]]))
    scale = grads[1].abs().max()
    assert scale > 0
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * scale  # float32 rounding only
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)


def test_prepared_tensors_carry_no_gradient(tiny, groups):
    model, tok = tiny
    trainer = Trainer(copy.deepcopy(model), TrainConfig(kl_coef=0.1), pad_id=tok.pad_token_id)
    prep, _ = trainer.prepare(clone(groups))
    for t in (prep.anchor, prep.weights, prep.mask, prep.token_adv, prep.ref, prep.seq_log_w):
        assert not t.requires_grad
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


@pytest.mark.parametrize("advantage", sorted(registry.names("advantage")))
@pytest.mark.parametrize("loss", ["ppo_clip", "dual_clip", "gspo"])
def test_every_named_choice_updates_and_stays_finite(tiny, groups, advantage, loss):
    model, tok = tiny
    cfg = TrainConfig(advantage=advantage, loss=loss, lr=1e-2)
    m = copy.deepcopy(model)
    gs = clone(groups)
    if advantage == "cod":  # its inputs live in sample meta (a Connect-the-Dots generator's)
        for i, g in enumerate(gs):
            for s in g.samples:
                s.meta.update(cod_key=(g.prompt_id, "solve", i), cod_return=s.reward)
    if advantage in ("trace", "trace_tree"):  # siblings by the prefix they continue
        for g in gs:
            for j, s in enumerate(g.samples):
                s.meta["trace_anchor"] = f"{g.prompt_id}@0"
                if advantage == "trace_tree" and j == 0:  # a root cut after its first token
                    s.meta["trace_cuts"] = [[1, f"{g.prompt_id}/{j}@1"]]
    if advantage == "mssr":  # each sample's baseline, as control.baseline puts it there
        for s in (s for g in gs for s in g.samples):
            s.meta["baseline"] = 0.4
    metrics = Trainer(m, cfg, pad_id=tok.pad_token_id).update(gs)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert all(v == v for v in metrics.values())  # no NaN metric
    assert metrics["train/tokens"] > 0


def test_mc_grpo_binary_rewards_zero_mad_trains_finite_and_drops_pivots(tiny, groups):
    model, tok = tiny
    gs = clone(groups)
    for g in gs:  # one success in four: median 0, MAD 0, |A| = 1000 for the success
        for j, s in enumerate(g.samples):
            s.reward = float(j == 0)
    m = copy.deepcopy(model)
    metrics = Trainer(m, TrainConfig(advantage="mc_grpo", lr=1e-2),
                      pad_id=tok.pad_token_id).update(gs)
    assert metrics["train/adv/mad_zero_groups"] == 2
    assert metrics["train/adv/abs_max"] == pytest.approx(1000.0)
    assert metrics["train/adv/dropped_samples"] == 2
    # the pivot: the lower middle of the group's rewards in stable order ([1, 0, 0, 0] sorts
    # as samples 1, 2, 3, 0: the second of the zeros)
    pivots = [sorted(g.samples, key=lambda s: s.reward)[(len(g.samples) - 1) // 2] for g in gs]
    assert all(p is g.samples[2] for p, g in zip(pivots, gs))
    assert metrics["train/dropped_tokens/pivot"] == sum(s.num_tokens for s in pivots)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert metrics["train/grad_norm"] == metrics["train/grad_norm"]


def test_gdpo_reads_the_named_reward_channels(tiny, groups):
    model, tok = tiny
    trainer = Trainer(copy.deepcopy(model), TrainConfig(advantage="gdpo",
                      reward_weights={"short": 0.5}), pad_id=tok.pad_token_id)
    gs = clone(groups)
    x = trainer.advantage_inputs(gs, trainer.rewards([s for g in gs for s in g.samples]))
    assert set(x.channels) == {"reward", "short"} and x.channel_weights == {"short": 0.5}
    gs[0].samples[0].rewards.pop("short")
    with pytest.raises(ValueError, match="lacks reward channel 'short'"):
        trainer.update(gs)


def _sum_logp(model, batch):
    with torch.no_grad():
        return token_logprobs(model, batch)


def test_kl_loss_is_zero_at_the_reference_and_pulls_back_toward_it(tiny, groups):
    model, tok = tiny
    cfg = TrainConfig(kl_coef=1.0, lr=1e-2, kl_estimator="k3", minibatches=1)
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    first = trainer.update(clone(groups))
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    second = trainer.update(clone(groups))
    assert second["train/kl_ref"] > 0
    # with zero advantages, the KL term alone must move the policy back toward the reference
    flat = clone(groups)
    for g in flat:
        for s in g.samples:
            s.reward = 0.0
    samples = [s for g in flat for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)

    def kl_now():
        lp, _ = _sum_logp(trainer.model, batch)
        ref, _ = _sum_logp(trainer.ref_model, batch)
        return float(((ref - lp).exp() - (ref - lp) - 1).mul(batch.loss_mask).sum())
    before = kl_now()
    trainer.update(flat)
    assert kl_now() < before


def test_kl_as_reward_penalty_lowers_the_rewards(tiny, groups):
    model, tok = tiny
    cfg = TrainConfig(kl_coef=0.5, kl_mode="reward", lr=1e-2, kl_estimator="k2")
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    raw = sum(s.reward for g in groups for s in g.samples) / 8
    first = trainer.update(clone(groups))
    assert first["train/reward_mean"] == pytest.approx(raw)  # policy = reference: no penalty
    second = trainer.update(clone(groups))
    assert second["train/kl_ref"] > 0 and second["train/reward_mean"] < raw


def test_entropy_bonus_raises_entropy_when_advantages_are_zero(tiny, groups):
    model, tok = tiny
    flat = clone(groups)
    for g in flat:
        for s in g.samples:
            s.reward = 1.0
    samples = [s for g in flat for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)

    def entropy(m):
        _, ent = _sum_logp(m, batch)
        return float((ent * batch.loss_mask).sum() / batch.loss_mask.sum())
    m = copy.deepcopy(model)
    before = entropy(m)
    Trainer(m, TrainConfig(entropy_coef=0.5, lr=1e-2), pad_id=tok.pad_token_id).update(flat)
    assert entropy(m) > before


@pytest.mark.parametrize("name, loss, agg", [("dapo", "ppo_clip", "token-mean"),
                                             ("gspo", "gspo", "seq-mean-token-mean")])
def test_presets_load_by_name(name, loss, agg):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"run.name={name}-test"])
    assert cfg.train.loss == loss and cfg.train.loss_agg == agg
    assert cfg.run.name == f"{name}-test"


def test_default_config_is_plain_grpo_per_sample_loop(tiny, groups):
    """Defaults = plain GRPO: group-normalised advantages, PPO-clip 0.2/0.2 against the
    recomputed old policy, mean over each sample's tokens then over samples, no KL, no
    correction. Reference: one sample at a time, no padding, plain Python arithmetic."""
    model, tok = tiny
    cfg = TrainConfig()
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=7)
    seen = capture_grads(trainer)
    trainer.update(clone(groups))
    order = torch.randperm(8, generator=torch.Generator().manual_seed(7 * 100003 + 0))
    first = order.chunk(cfg.minibatches)[0].tolist()
    samples = [s for g in groups for s in g.samples]
    adv = []
    for g in groups:
        r = [s.reward for s in g.samples]
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / (len(r) - 1)) ** 0.5
        adv += [(x - mean) / (std + 1e-6) for x in r]
    ref = copy.deepcopy(model)
    per_sample = []
    for i in first:
        s = samples[i]
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = ref(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
        old = logp.detach()  # the old policy is the model itself before the first step
        terms = []
        for t in range(s.num_tokens):
            ratio = torch.exp(logp[t] - old[t])
            terms.append(-torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.2) * adv[i]))
        per_sample.append(sum(terms) / len(terms))
    (sum(per_sample) / len(per_sample)).backward()
    naive = torch.cat([p.grad.flatten() for p in ref.parameters()])
    naive = naive * min(1.0, cfg.grad_clip / float(naive.norm()))  # the step sees clipped grads
    ours = torch.cat([g.flatten() for g in seen[0]])
    assert (naive - ours).abs().max() <= 1e-5 * naive.abs().max()


def _equal_rewards(groups, which: list[int]):
    """A copy of groups where the groups at `which` have every reward equal (advantage 0)."""
    out = clone(groups)
    for i in which:
        for s in out[i].samples:
            s.reward, s.rewards = 1.0, {"reward": 1.0, "short": 1.0}
    return out


def _rows_through_model(trainer) -> list[int]:
    rows = []
    trainer.model.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    return rows


@pytest.mark.parametrize("loss, agg", [("ppo_clip", "seq-mean-token-mean"),
                                       ("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean")])
def test_skipping_zero_advantage_rows_gives_the_same_update(tiny, loss, agg):
    """Groups with equal rewards add exactly 0 to the gradient; skipping their forward and
    backward passes must leave every optimizer step's gradient (and the weights) unchanged,
    while they still count in the aggregation's denominators."""
    model, tok = tiny
    groups = _equal_rewards(make_groups(model, tok, n_prompts=4, group_size=4,
                                        max_new_tokens=6, seed=5), [1, 3])
    grads, params, rows = [], [], []
    for skip in (False, True):
        cfg = TrainConfig(loss=loss, loss_agg=agg, minibatches=2, skip_zero_advantage=skip,
                          pack_prompts=False,  # rows counted unpacked, and no check
                          chunked_logits=False,  # of a fast path forwards rows of its own
                          old_logprobs_from_engine=False)  # every old log-prob recomputed
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=1)
        seen, through = capture_grads(trainer), _rows_through_model(trainer)
        m = trainer.update(clone(groups))
        grads.append([torch.cat([g.flatten() for g in step]) for step in seen])
        params.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
        rows.append(sum(through))
        assert m["train/tokens"] > 0
    assert len(grads[0]) == len(grads[1]) == 2
    for a, b in zip(*grads):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-6 * a.abs().max()
    assert (params[0] - params[1]).abs().max() <= 1e-6
    # every row passes once for the old log-probs; the first minibatch's training rows take
    # that pass with gradient and reuse it, so only the second minibatch's pass is extra:
    # its 8 rows unskipped, its moving rows skipped
    second = torch.randperm(16, generator=torch.Generator().manual_seed(1 * 100003)).chunk(2)[1]
    moving_second = sum(1 for i in second.tolist() if i // 4 not in (1, 3))
    assert 0 < moving_second < 8
    assert rows == [16 + 8, 16 + moving_second]


def test_a_step_with_no_moving_row_still_steps_adamw_like_a_zero_gradient(tiny):
    """After an informative update, an update where every group has equal rewards runs no
    training pass, yet AdamW's momentum and weight decay move the weights exactly as a zero
    gradient does (the unskipped path)."""
    model, tok = tiny
    first = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=7)
    second = _equal_rewards(first, [0, 1])
    out = []
    for skip in (False, True):
        cfg = TrainConfig(minibatches=1, skip_zero_advantage=skip, weight_decay=0.1,
                          pack_prompts=False)
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
        trainer.update(clone(first))
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        through = _rows_through_model(trainer)
        trainer.update(clone(second))
        after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        assert (after - before).abs().max() > 0  # momentum moved them
        out.append((after, sum(through)))
    assert torch.equal(out[0][0], out[1][0])
    # one pass per row both times: unskipped, the old log-probs' pass is the training pass
    assert out[0][1] == 8 and out[1][1] == 8


def test_zero_advantage_rows_are_not_skipped_when_a_term_needs_them(tiny):
    """An entropy bonus or a KL loss term gives zero-advantage rows a gradient: no skip."""
    model, tok = tiny
    groups = _equal_rewards(make_groups(model, tok, n_prompts=2, group_size=4,
                                        max_new_tokens=6, seed=5), [1])
    for extra in ({"entropy_coef": 0.01}, {"kl_coef": 0.1, "kl_mode": "loss"}):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, pack_prompts=False,
                                                            **extra),
                          pad_id=tok.pad_token_id)
        through = _rows_through_model(trainer)
        trainer.update(clone(groups))
        assert through[-1] == 8, extra  # the training pass saw every row


def test_the_first_step_reuses_the_old_logprob_pass_and_keeps_its_gradient(tiny, groups):
    """An update's first optimizer step runs on the weights the old log-probs are taken
    with, so one pass with gradient serves both on that minibatch's rows: the gradients
    equal those of separate passes up to float rounding, with fewer rows through the model."""
    model, tok = tiny
    grads, rows = [], []
    for reuse in (False, True):
        cfg = TrainConfig(minibatches=2, lr=1e-3, pack_prompts=False,
                          chunked_logits=False)  # no first-update check: it forwards rows too
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=2)
        if not reuse:
            trainer._first_rows = lambda batch, rows, advantages: None
        seen, through = capture_grads(trainer), _rows_through_model(trainer)
        m = trainer.update(clone(groups))
        assert m["train/tokens"] > 0
        grads.append([torch.cat([g.flatten() for g in step]) for step in seen])
        rows.append(sum(through))
    assert len(grads[0]) == len(grads[1]) == 2
    for step, (a, b) in enumerate(zip(*grads)):
        assert a.abs().max() > 0
        assert (a - b).abs().max() <= (1e-5 if step == 0 else 1e-4) * a.abs().max()
    assert rows[1] < rows[0] == 8 + 8  # separate: 8 old-log-prob rows + the moving ones


def _update_with(model, tok, groups, **cfg) -> tuple[list[torch.Tensor], dict, list[int]]:
    trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2, lr=1e-3, **cfg),
                      pad_id=tok.pad_token_id, seed=2)
    through = _rows_through_model(trainer)
    m = trainer.update(groups)
    return [p.detach().clone() for p in trainer.model.parameters()], m, through


def test_engine_log_probs_stand_for_the_old_policy_only_when_checked_equal(tiny, groups):
    """The second minibatch's old log-probs come from the engine when the first minibatch's
    pass agrees with the engine within the tolerance: the weights then equal the recomputed
    update's up to that tolerance, and one no-grad pass is saved. A larger gap, a stale token,
    a TIS/MIS correction (it measures every token's mismatch) or the option off takes the
    pass, and the update is the recomputed one exactly."""
    model, tok = tiny
    on_policy = clone(groups)
    set_on_policy(on_policy, model, tok.pad_token_id, version=0)
    ref_w, ref_m, ref_rows = _update_with(model, tok, clone(on_policy),
                                          old_logprobs_from_engine=False)
    assert ref_m["train/old_logprobs_from_engine"] == 0.0
    nudged = clone(on_policy)  # an engine that agrees to 5e-6: rounding of another kernel
    gen = torch.Generator().manual_seed(0)
    for s in (s for g in nudged for s in g.samples):
        s.logprobs = [x + 5e-6 * (2 * float(torch.rand(1, generator=gen)) - 1)
                      for x in s.logprobs]
    w, m, rows = _update_with(model, tok, clone(nudged))
    assert m["train/old_logprobs_from_engine"] == 1.0
    assert m["train/old_logprobs_engine_gap_max"] <= 1e-4
    assert sum(rows) < sum(ref_rows)  # the no-grad pass over the other rows is gone
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w, ref_w))

    far = clone(on_policy)  # one token of each sample off by 0.01: the check fails
    for s in (s for g in far for s in g.samples):
        s.logprobs[0] += 0.01
    stale = clone(nudged)
    stale[-1].samples[-1].versions = [-3] * len(stale[-1].samples[-1].versions)
    tis = {"correction": CorrectionConfig(mode="tis")}
    for case, cfg in ((far, {}), (stale, {}), (nudged, {"old_logprobs_from_engine": False}),
                      (nudged, tis)):
        w2, m2, rows2 = _update_with(model, tok, clone(case), **cfg)
        assert m2["train/old_logprobs_from_engine"] == 0.0
        assert sum(rows2) == sum(ref_rows)
    # with the pass taken, only the anchor's own inputs differ from the reference: none here
    w3, _, _ = _update_with(model, tok, clone(far), old_logprobs_tolerance=0.0)
    assert all(torch.equal(a, b) for a, b in zip(w3, _update_with(
        model, tok, clone(far), old_logprobs_from_engine=False)[0]))


def test_a_kept_first_pass_is_used_by_the_first_step_only(tiny, groups):
    """Prepared.first is consumed by the first optimizer step, even one that is skipped."""
    model, tok = tiny
    trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2), pad_id=tok.pad_token_id)
    first_mb = torch.arange(4)
    prep, _ = trainer.prepare(clone(groups), first_mb)
    rows, logp, _ = prep.first
    assert len(rows) > 0 and torch.isin(rows, first_mb).all() and logp.requires_grad
    assert torch.equal(logp.detach(), prep.anchor[rows, :logp.shape[1]])
    prep.mask[:] = 0  # nothing to train: the step is skipped
    trainer._optimizer_step(prep, first_mb)
    assert prep.first is None


def test_an_update_with_no_groups_advances_the_schedule_quietly(tiny, groups):
    """Every group filtered out: no optimizer step, but the lr schedule and the policy version
    follow the RL step, and torch's scheduler-before-optimizer warning is not shown."""
    import warnings
    model, tok = tiny
    cfg = TrainConfig(lr=1e-3, lr_end_factor=0.5, steps=4, minibatches=1, warmup_steps=2)
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 2)  # warming up
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        trainer.update([])
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.version == 1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 0.5 / 4))
    m = trainer.update(clone(groups))
    assert m["train/lr"] == pytest.approx(1e-3 * (1 - 0.5 * 1 / 4))


def test_minibatch_groups_takes_one_optimizer_step_per_that_many_groups(tiny):
    """train.minibatch_groups = k: an update on n groups takes ceil(n / k) optimizer steps
    whatever train.minibatches says; k >= n is exactly the one-step update."""
    model, tok = tiny
    five = make_groups(model, tok, n_prompts=5, group_size=4, max_new_tokens=6, seed=3)
    weights = {}
    for per, want in ((1, 5), (2, 3), (4, 2), (5, 1), (9, 1)):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=4, minibatch_groups=per),
                          pad_id=tok.pad_token_id)
        seen = capture_grads(trainer)
        m = trainer.update(clone(five))
        assert len(seen) == want and m["train/minibatches"] == want, per
        weights[per] = [p.detach().clone() for p in trainer.model.parameters()]
    one = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1), pad_id=tok.pad_token_id)
    one.update(clone(five))
    for per in (5, 9):
        assert all(torch.equal(a, b) for a, b in zip(weights[per], one.model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], one.model.parameters()))


def test_minibatch_groups_cannot_map_onto_trl():
    from rollwise.bench.e2e_trl import trl_batch_args
    with pytest.raises(ValueError, match="train.minibatch_groups"):
        trl_batch_args(load_config(None, ["train.minibatch_groups=2"]))
    with pytest.raises(ValueError):
        load_config(None, ["train.minibatch_groups=0"])


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_dropped_groups_count_in_the_denominators_as_if_they_were_trained_on(tiny, agg):
    """loss_denominator = generated: training on the kept groups while the dropped ones (all
    advantages 0) only count in the denominators gives the gradient of training on all of
    them, computed here the long way (every group through the trainer, one optimizer step so
    the minibatch split cannot differ). loss_denominator = kept ignores them: a larger
    gradient, by the ratio of the counts (gradient clipping off)."""
    model, tok = tiny
    groups = _equal_rewards(make_groups(model, tok, n_prompts=4, group_size=4,
                                        max_new_tokens=6, seed=5), [1, 3])
    kept, dropped = [groups[0], groups[2]], [groups[1], groups[3]]
    grads = {}
    for mode, trained, absent in [("all", groups, []), ("generated", kept, dropped),
                                  ("kept", kept, dropped)]:
        cfg = TrainConfig(loss_agg=agg, minibatches=1, grad_clip=1e9,
                          loss_denominator="kept" if mode == "all" else mode)
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=1)
        seen = capture_grads(trainer)
        trainer.update(clone(trained), clone(absent))
        grads[mode] = torch.cat([g.flatten() for g in seen[0]])
    ref = grads["all"]
    assert ref.abs().max() > 0
    assert (grads["generated"] - ref).abs().max() <= 1e-6 * ref.abs().max()
    if agg == "seq-mean-token-mean":  # 16 sequences against the 8 kept ones
        assert torch.allclose(grads["kept"], 2 * ref, rtol=1e-4, atol=1e-7)
    else:  # every token of the 16 sequences against the kept ones' tokens
        n_all = sum(s.num_tokens for g in groups for s in g.samples)
        n_kept = sum(s.num_tokens for g in kept for s in g.samples)
        assert torch.allclose(grads["kept"], ref * n_all / n_kept, rtol=1e-4, atol=1e-7)
