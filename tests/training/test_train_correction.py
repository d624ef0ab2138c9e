"""Importance correction: weights against naive loops, the exact mismatch x staleness split
with weight snapshots, the staleness limit, ESS and VCPO's learning-rate scale, and the
invariance "behaviour = current policy at staleness 0 -> corrected loss = uncorrected"."""

import copy
import math

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups, params_equal, set_on_policy

from rollwise.config import CorrectionConfig, TrainConfig
from rollwise.training import correction as corr
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch

# log(anchor / behaviour): each level has tokens/sequences inside and outside [0.6, 1.5]
LOG_RATIO = torch.tensor([[0.1, -0.2, 0.05, 0.0, 9.0],  # sequence sum -0.05: inside
                          [7.0, 0.9, -0.1, 0.2, 0.3],  # sum 1.3: above; token 0.9 above
                          [-1.0, 0.3, 0.0, 0.0, 0.0]])  # sum -0.7: below; token -1.0 below
MASK = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float)


def naive_weights(mode, level, low, high):
    w = [[0.0] * 5 for _ in range(3)]
    for i in range(3):
        seq = sum(LOG_RATIO[i, t].item() for t in range(5) if MASK[i, t])
        for t in range(5):
            if not MASK[i, t]:
                continue
            rho = math.exp(seq if level == "sequence" else LOG_RATIO[i, t].item())
            if mode == "tis":
                w[i][t] = min(rho, high)
            else:
                w[i][t] = rho if low <= rho <= high else 0.0
    return w


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_match_naive_loop(mode, level):
    out = corr.importance_weights(LOG_RATIO, MASK, mode, level, low=0.6, high=1.5)
    ref = naive_weights(mode, level, 0.6, 1.5)
    assert out.weights.tolist() == [pytest.approx(r, rel=1e-5) for r in ref]
    rejected = sum(1 for i in range(3) for t in range(5) if MASK[i, t] and ref[i][t] == 0)
    assert out.metrics["is_rejected_frac"] == pytest.approx(rejected / MASK.sum().item())
    if mode == "mis":
        assert ((out.keep == 0) & (MASK > 0)).sum() == rejected
    if mode == "mis":
        assert 0 < rejected < MASK.sum()  # both regimes exercised
    else:
        assert out.metrics["is_truncated_frac"] > 0 and out.weights.max() == 1.5


def test_icepop_is_the_two_sided_token_mask():
    out = corr.importance_weights(LOG_RATIO, MASK, "icepop", "token", low=0.6, high=1.5)
    assert out.weights.tolist() == [pytest.approx(r, rel=1e-5)
                                    for r in naive_weights("mis", "token", 0.6, 1.5)]
    with pytest.raises(ValueError, match="level = token"):
        corr.importance_weights(LOG_RATIO, MASK, "icepop", "sequence")
    with pytest.raises(ValueError, match="level = token"):
        CorrectionConfig(mode="icepop", level="sequence")


def test_carried_kv_metrics_by_version_age_and_tokens_since_the_sync():
    """Row 0 spans versions 1 -> 3 (continued across a sync), row 1 is version 3 alone, row 2
    version 2; the trainer is at 3. Against a loop over the tokens."""
    T = 300
    versions = torch.full((3, T), 3)
    versions[0, :5] = 1
    versions[2] = 2
    mask = torch.ones(3, T)
    mask[1, 200:] = 0
    g = torch.Generator().manual_seed(0)
    d = 0.3 * torch.randn(3, T, generator=g)  # log(pi_prox / mu)
    mu = -torch.rand(3, T, generator=g)
    m = corr.carried_kv_metrics(mu + d, mu, versions, 3, mask)
    assert (m["tokens_age_0"], m["tokens_age_1"], m["tokens_age_2"]) == (495, 300, 5)
    k3 = [[math.exp(x) - 1 - x for x in row] for row in d.tolist()]
    assert m["kl_one_version"] == pytest.approx(sum(k3[1][:200]) / 200, rel=1e-5)
    since = {"0_16": (5, 21), "16_64": (21, 69), "64_256": (69, 261), "256+": (261, T)}
    for name, (a, b) in since.items():
        assert m[f"kl_since_sync_{name}"] == pytest.approx(sum(k3[0][a:b]) / (b - a), rel=1e-5)
        assert m[f"tokens_since_sync_{name}"] == b - a


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match="train.correction.mode"):
        corr.importance_weights(LOG_RATIO, MASK, "clip")


def test_staleness_limit_keeps_recent_tokens_only():
    versions = torch.tensor([[5, 5, 4, 2, -1]])
    keep = corr.staleness_keep(versions, 5, torch.tensor([[1.0, 1, 1, 1, 0]]), max_staleness=1)
    assert keep.tolist() == [[1, 1, 1, 0, 0]]
    assert corr.staleness(versions, 5)[0, :4].tolist() == [0, 0, 1, 3]


def test_ess_closed_forms_and_vcpo_scale():
    assert corr.effective_sample_size(torch.zeros(8)) == pytest.approx(8.0)
    assert corr.effective_sample_size(torch.tensor([0.0, -50.0, -50.0])) == pytest.approx(1.0)
    lw = torch.randn(10)
    w = lw.double().exp()
    assert corr.effective_sample_size(lw) == pytest.approx(float(w.sum() ** 2 / (w ** 2).sum()))
    shifted = corr.effective_sample_size(lw.double() + 300.0)  # no overflow, same ESS
    assert shifted == pytest.approx(corr.effective_sample_size(lw), rel=1e-9)
    assert corr.vcpo_lr_scale(0.25) == pytest.approx(0.5)
    assert corr.vcpo_lr_scale(1.0) == 1.0 and corr.vcpo_lr_scale(0.5, rho0=0.25) == 1.0


CORRECTED = [
    dict(mode="tis"), dict(mode="mis"), dict(mode="tis", level="sequence"),
    dict(mode="mis", level="sequence", low=0.9, high=1.1),
    dict(mode="tis", anchor="version", snapshots=2), dict(max_staleness=0),
    dict(vcpo_lr=True),
]


@pytest.mark.parametrize("loss", ["ppo_clip", "dual_clip", "gspo"])
@pytest.mark.parametrize("options", CORRECTED,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_on_policy_at_staleness_zero_corrected_equals_uncorrected(tiny, loss, options):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4)
    set_on_policy(groups, model, tok.pad_token_id, version=0)
    clip = 0.2 if loss != "gspo" else 0.01
    base = TrainConfig(lr=1e-2, loss=loss, clip_low=clip, clip_high=clip)
    fixed = base.model_copy(update={"correction": CorrectionConfig(**options)})
    results = []
    for cfg in (base, fixed):
        m = copy.deepcopy(model)
        trainer = Trainer(m, cfg, pad_id=tok.pad_token_id)
        grads = capture_grads(trainer)
        metrics = trainer.update(clone(groups))
        results.append((m, grads, metrics))
    (m0, g0, s0), (m1, g1, s1) = results
    assert len(g0) == len(g1) == 2 and any(g.abs().sum() > 0 for g in g0[0])
    # equal up to float rounding: the first minibatch's old log-probs come from its own pass
    # with gradient, whose kernels round differently from the no-grad pass behind mu; Adam at
    # lr 1e-2 magnifies that on the second step (a wrong weight would move O(1), not 1e-4)
    for step, (a, b) in enumerate(zip(g0, g1)):
        for p, q in zip(a, b):
            rel = float((p - q).abs().max() / p.abs().max().clamp_min(1e-12))
            assert rel <= (1e-5 if step == 0 else 1e-3), (step, rel)
    assert params_equal(m0, m1, atol=1e-4)
    assert s1["train/loss"] == pytest.approx(s0["train/loss"], rel=1e-4, abs=1e-8)
    assert s1["train/correction/ess_frac"] == pytest.approx(1.0)
    assert s1["train/lr_scale"] == pytest.approx(1.0, abs=1e-9)  # float rounding only
    assert sum(v for k, v in s1.items() if k.startswith("train/dropped_tokens/")) == 0


def _stale_setup(tiny, snapshots):
    """Samples drawn at version 0, trained on at version 2 after two other updates."""
    model, tok = tiny
    model = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    stale = make_groups(model, tok, n_prompts=2, group_size=4, seed=5, version=0)
    cfg = TrainConfig(lr=1e-2, correction=CorrectionConfig(snapshots=snapshots))
    trainer = Trainer(model, cfg, pad_id=tok.pad_token_id)
    for seed in (1, 2):
        fresh = make_groups(model, tok, seed=seed, version=trainer.version)
        trainer.update(fresh)
    return trainer, initial, stale


def test_snapshots_split_the_ratio_exactly_into_mismatch_and_staleness(tiny):
    trainer, initial, stale = _stale_setup(tiny, snapshots=2)
    assert trainer.version == 2 and sorted(trainer._snapshots) == [0, 1]
    samples = [s for g in stale for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), trainer.pad_id)
    with torch.no_grad():
        prox, _ = token_logprobs(trainer.model, batch)
        pi_v, known = trainer._version_logprobs(batch, prox)
        direct, _ = token_logprobs(initial, batch)  # the version-0 weights, independently
    mask = batch.loss_mask > 0
    assert known[mask].all()
    assert torch.allclose(pi_v[mask], direct[mask], atol=1e-5)
    mu = batch.behaviour_logprobs
    mismatch, drift = pi_v - mu, prox - pi_v
    assert mismatch[mask].abs().max() < 1e-4  # the engine ran the same weights
    assert drift[mask].abs().max() > 1e-3  # two updates moved the policy
    assert torch.allclose((mismatch + drift)[mask], (prox - mu)[mask], atol=1e-6)
    metrics = trainer.update(stale)
    assert metrics["train/correction/unsplit_tokens"] == 0
    assert metrics["train/correction/staleness_mean"] == pytest.approx(2.0)
    assert metrics["train/correction/mismatch_abs_log_ratio"] < 1e-4
    assert metrics["train/correction/staleness_abs_log_ratio"] > 1e-3


def test_without_snapshots_stale_tokens_are_counted_unsplit(tiny):
    trainer, _, stale = _stale_setup(tiny, snapshots=0)
    n = sum(s.num_tokens for g in stale for s in g.samples)
    metrics = trainer.update(stale)
    assert metrics["train/correction/unsplit_tokens"] == n


def test_staleness_limit_drops_old_tokens_and_skips_an_empty_step(tiny):
    trainer, _, stale = _stale_setup(tiny, snapshots=0)
    trainer.cfg = trainer.cfg.model_copy(update={"correction": CorrectionConfig(max_staleness=1)})
    before = copy.deepcopy(trainer.model)
    metrics = trainer.update(stale)
    n = sum(s.num_tokens for g in stale for s in g.samples)
    assert metrics["train/dropped_tokens/stale"] == n and metrics["train/tokens"] == 0
    assert metrics["train/skipped_frac"] == 1.0
    assert params_equal(before, trainer.model)


def test_version_anchor_drops_tokens_without_a_snapshot(tiny):
    trainer, _, stale = _stale_setup(tiny, snapshots=1)  # keeps version 1 only
    trainer.cfg = trainer.cfg.model_copy(update={"correction": CorrectionConfig(
        anchor="version", snapshots=1)})
    metrics = trainer.update(stale)
    n = sum(s.num_tokens for g in stale for s in g.samples)
    assert metrics["train/dropped_tokens/no_snapshot"] == n


def test_mis_rejects_tokens_with_engine_mismatch_and_counts_them(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4)
    set_on_policy(groups, model, tok.pad_token_id, version=0)
    bad = 0
    for g in groups:
        s = g.samples[2]
        s.logprobs[0] += 3.0  # the engine claims e^3 more probability: ratio e^-3 < 0.5
        bad += 1
    cfg = TrainConfig(correction=CorrectionConfig(mode="mis", low=0.5, high=2.0))
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    metrics = trainer.update(groups)
    assert metrics["train/dropped_tokens/mis"] == bad
    assert metrics["train/correction/total_ratio_max"] == pytest.approx(1.0, abs=1e-5)


def test_vcpo_scales_the_step_by_root_ess_fraction(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4)
    set_on_policy(groups, model, tok.pad_token_id, version=0)
    for g in groups:  # make the behaviour policy disagree on whole sequences
        for j, s in enumerate(g.samples):
            s.logprobs = [lp + 0.4 * (j - 1.5) for lp in s.logprobs]
    cfg = TrainConfig(minibatches=1, correction=CorrectionConfig(vcpo_lr=True))
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id)
    metrics = trainer.update(groups)
    assert metrics["train/lr_scale"] == pytest.approx(
        math.sqrt(metrics["train/correction/ess_frac"]), rel=1e-6)
    assert metrics["train/lr_scale"] < 0.95
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.scheduler.get_last_lr()[0])  # the scale applied to that step only


def test_an_episodes_turns_split_by_their_own_versions(tiny):
    """Missing Old Logits (METHODS §3.11) for an agent episode that spans versions: turn 1 was
    sampled at version 0, turn 2 at version 1, the environment's tokens between them at none.
    Each turn's anchor is its own version's policy; the environment's tokens stay out."""
    from rollwise.types import Sample
    trainer, initial, _ = _stale_setup(tiny, snapshots=2)
    v1 = copy.deepcopy(initial)
    v1.load_state_dict(trainer._snapshots[1])
    s = Sample(prompt_id="p", prompt_ids=[3, 13, 3, 16])
    s.extend([4, 5, 6], [-1.0] * 3, [0] * 3)  # turn 1
    s.extend([20, 21], [0.0] * 2, [-1] * 2, trainable=False)  # the environment
    s.extend([7, 8], [-1.0] * 2, [1] * 2)  # turn 2
    batch = Batch.from_samples([s], [0.0], trainer.pad_id)
    with torch.no_grad():
        prox, _ = token_logprobs(trainer.model, batch)
        pi_v, known = trainer._version_logprobs(batch, prox)
        at0, _ = token_logprobs(initial, batch)
        at1, _ = token_logprobs(v1, batch)
    start = len(s.prompt_ids) - 1  # the target column of the first response token
    turn1, env, turn2 = (slice(start, start + 3), slice(start + 3, start + 5),
                         slice(start + 5, start + 7))
    assert known[0, start:start + 7].all()
    assert torch.allclose(pi_v[0, turn1], at0[0, turn1], atol=1e-5)
    assert torch.allclose(pi_v[0, turn2], at1[0, turn2], atol=1e-5)
    assert not torch.allclose(at0[0, turn2], at1[0, turn2], atol=1e-4)  # versions differ
    assert batch.loss_mask[0, env].sum() == 0 and batch.versions[0, env].tolist() == [-1, -1]
