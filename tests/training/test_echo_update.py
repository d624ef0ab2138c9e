"""ECHO's update side (rollwise/training/confidence.py): the entropy-confidence shaping and the
confidence-adaptive clip, against naive per-token loops and one unpadded forward per sample."""

import copy
import math
import statistics

import engine_contract as contract
import torch
from train_helpers import capture_grads, clone, make_groups

from rollwise.config import TrainConfig
from rollwise.training.confidence import echo_clip, echo_score, policy_token_stats, tail_confidence
from rollwise.training.losses import LossParams, dual_clip, ppo_clip
from rollwise.training.trainer import Trainer
from rollwise.types import Batch


def _naive_stats(model, samples):
    """Per sample, (entropy, top-5 confidence) lists over its response targets, from one
    unpadded forward each."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            p = model(input_ids=ids).logits[0].float().softmax(-1)
            rows = range(len(s.prompt_ids) - 1, len(s.prompt_ids) + s.num_tokens - 1)
            ent = [float(-(p[t] * p[t].log()).sum()) for t in rows]
            conf = [float(sorted(p[t].tolist(), reverse=True)[:5][i]) for t in rows
                    for i in range(5)]
            out.append((ent, [sum(conf[5 * i:5 * i + 5]) / 5 for i in range(len(ent))]))
    return out


def _naive_scores(stats):
    """S per token: z(H) + z(1 - c) over every response token of the batch, clamped to 2."""
    H = [h for e, _ in stats for h in e]
    U = [1 - c for _, cs in stats for c in cs]
    z = lambda x, xs: (x - statistics.mean(xs)) / math.sqrt(statistics.variance(xs) + 1e-8)  # noqa
    return [[max(-2.0, min(2.0, z(h, H) + z(1 - c, U))) for h, c in zip(e, cs)]
            for e, cs in stats]


def test_policy_stats_match_one_unpadded_forward_per_sample():
    model, tok = contract.wild_model(seed=3)
    groups = make_groups(model, tok, n_prompts=3, group_size=3, max_new_tokens=6)
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), 0)
    naive = _naive_stats(model, samples)
    for chunks in (None, list(torch.arange(batch.size).split(2))):  # one pass, or 2 rows each
        ent, conf = policy_token_stats(model, batch, chunks)
        for i, (s, (e, c)) in enumerate(zip(samples, naive)):
            at = batch.loss_mask[i] > 0
            assert torch.allclose(ent[i][at], torch.tensor(e), atol=1e-5)
            assert torch.allclose(conf[i][at], torch.tensor(c), atol=1e-6)
        assert (conf <= 1).all() and (conf[batch.attention_mask[:, 1:] == 0] == 0).all()


def test_echo_score_is_the_clamped_sum_of_two_whitened_statistics():
    torch.manual_seed(0)
    H, c = torch.rand(3, 7) * 3, torch.rand(3, 7)
    H[1, 2] = 40.0  # an outlier whose score the clamp holds at 2
    mask = torch.ones(3, 7)
    mask[0, 5:] = 0
    mask[2, :2] = 0
    stats = [([float(h) for h, m in zip(H[i], mask[i]) if m],
              [float(x) for x, m in zip(c[i], mask[i]) if m]) for i in range(3)]
    want = _naive_scores(stats)
    got = echo_score(H, c, mask)
    for i in range(3):
        assert torch.allclose(got[i][mask[i] > 0], torch.tensor(want[i]), atol=1e-5)
    assert float(got[1, 2]) == 2.0 and (got[mask == 0] == 0).all()


def test_tail_confidence_and_the_clip_eps_in_closed_form():
    c = torch.linspace(0, 1, 30).repeat(2, 1)
    mask = torch.ones(2, 30)
    mask[1, 20:] = 0  # row 1's response ends at column 19
    mask[1, :3] = 0
    tail = tail_confidence(c, mask)
    assert torch.allclose(tail, torch.stack([c[0, 14:].mean(), c[1, 4:20].mean()]))
    short = torch.zeros(1, 30)
    short[0, 10:13] = 1  # fewer than 16 tokens: all of them
    assert torch.isclose(tail_confidence(c[:1], short)[0], c[0, 10:13].mean())
    assert float(tail_confidence(c[:1], torch.zeros(1, 30))[0]) == 1.0
    eps = lambda ct: float(echo_clip(torch.full((1, 4), ct), torch.ones(1, 4)))  # noqa: E731
    assert math.isclose(eps(1.0), 0.125, abs_tol=1e-7)  # the sure end: 0.05 + 0.15 / 2
    assert math.isclose(eps(0.0), 0.05 + 0.15 / (1 + math.exp(-4)), abs_tol=1e-7)
    assert eps(0.2) > eps(0.5) > eps(0.9)  # eps falls as the tail grows sure


def test_per_row_clip_eps_equals_each_row_with_its_own_scalar_eps():
    torch.manual_seed(1)
    logp, old = torch.randn(4, 6) * 0.3, torch.randn(4, 6) * 0.3
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -2.0]), torch.ones(4, 6)
    eps = torch.tensor([[0.05], [0.1], [0.15], [0.2]])
    for fn in (ppo_clip, dual_clip):
        rows, _ = fn(logp, old, adv, mask, LossParams(eps, eps))
        for i in range(4):
            e = float(eps[i])
            one, _ = fn(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                        LossParams(e, e))
            assert torch.allclose(rows[i], one[0])


def _shaped_by_hand(model, groups):
    """(B, T-1) token advantages A (1 + 0.1 S) laid out as Batch.from_samples lays them."""
    samples = [s for g in groups for s in g.samples]
    scores = _naive_scores(_naive_stats(model, samples))
    trainer = Trainer(copy.deepcopy(model), TrainConfig(), pad_id=0)
    adv = trainer._advantages(groups, trainer.rewards(samples)).advantages
    batch = Batch.from_samples(samples, [0.0] * len(samples), 0)
    out = torch.zeros_like(batch.loss_mask)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        out[i, start:start + s.num_tokens] = adv[i] * (1 + 0.1 * torch.tensor(scores[i]))
    return out


def test_echo_shaping_and_clip_in_an_update_equal_the_same_update_given_them_by_hand():
    """train.token_shaping=echo and adaptive_clip=echo give the gradient of a trainer whose
    shaping hook returns advantages shaped by hand (naive statistics), and each sequence's
    eps is the closed form of its own tail."""
    model, tok = contract.wild_model(seed=3)
    groups = make_groups(model, tok, n_prompts=3, group_size=4, max_new_tokens=6, seed=2)
    for g in groups:
        for j, s in enumerate(g.samples):
            s.reward = float(j % 2)
            s.versions = [0] * s.num_tokens
    by_hand = _shaped_by_hand(model, groups)
    stats = _naive_stats(model, [s for g in groups for s in g.samples])
    grads = []
    for echo in (True, False):
        cfg = TrainConfig(minibatches=1, warmup_steps=0, token_shaping="echo" if echo else "none",
                          adaptive_clip="echo")
        trainer = Trainer(copy.deepcopy(model), cfg, pad_id=0, seed=1)
        if not echo:
            trainer.shaping = lambda adv, batch: by_hand[:, :adv.shape[1]] * (adv != 0)
        prep, m = trainer.prepare(clone(groups))
        on = prep.batch.loss_mask > 0  # elsewhere the shaping leaves A: the loss masks it
        assert torch.allclose(prep.token_adv[on], by_hand[:, :on.shape[1]][on], atol=1e-5)
        for i, (_, c) in enumerate(stats):
            c_tail = sum(c[-16:]) / len(c[-16:])
            assert math.isclose(float(prep.clip[i]),
                                0.05 + 0.15 / (1 + math.exp(-4 * (1 - c_tail))), abs_tol=1e-6)
        seen = capture_grads(trainer)
        out = trainer.update(clone(groups))
        assert 0.125 <= out["train/clip_eps_mean"] <= 0.2
        grads.append(torch.cat([g.flatten() for g in seen[0]]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
