"""Policy losses, aggregations and KL estimators against naive loops, closed forms and
autograd on the papers' sequence-level objectives."""

import math

import pytest
import torch

from rollwise import registry
from rollwise.training.losses import LossParams, aggregate, get_policy_loss, kl_k1, kl_k2, kl_k3

torch.manual_seed(0)
B, T = 4, 6
MASK = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0],
                     [0, 1, 1, 1, 0, 0]], dtype=torch.float)
OLD = torch.randn(B, T) * 0.3 - 1.5
NEW = OLD + torch.randn(B, T) * 0.4  # ratios spread around 1, many outside the clip band
ADV = torch.tensor([1.5, -0.7, -2.0, 0.4])


def naive_ppo(lp, old, adv, lo, hi, dual_c=None):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            r = math.exp(lp[i][t] - old[i][t])
            a = adv[i]
            obj = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if dual_c is not None and a < 0:
                obj = max(obj, dual_c * a)
            out[i][t] = -obj
    return out


@pytest.mark.parametrize("lo, hi", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_matches_naive_loop(lo, hi):
    loss, m = get_policy_loss("ppo_clip")(NEW, OLD, ADV, MASK, LossParams(lo, hi))
    ref = naive_ppo(NEW.tolist(), OLD.tolist(), ADV.tolist(), lo, hi)
    assert loss.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in ref]
    r = (NEW - OLD).exp()
    high = ((ADV[:, None] > 0) & (r > 1 + hi) & (MASK > 0)).sum() / MASK.sum()
    low = ((ADV[:, None] < 0) & (r < 1 - lo) & (MASK > 0)).sum() / MASK.sum()
    assert m["clip_frac_high"] == pytest.approx(float(high))
    assert m["clip_frac_low"] == pytest.approx(float(low))
    assert m["clip_frac"] == pytest.approx(float(high + low))
    assert 0 < m["clip_frac"] < 1  # the fixture exercises both regimes


def test_dual_clip_matches_naive_loop_and_bounds_negative_advantages():
    big = OLD.clone()
    big[2] += 2.0  # ratio e^2 on a negative-advantage row: the dual clip binds
    loss, m = get_policy_loss("dual_clip")(big, OLD, ADV, MASK, LossParams(0.2, 0.2, 3.0))
    ref = naive_ppo(big.tolist(), OLD.tolist(), ADV.tolist(), 0.2, 0.2, dual_c=3.0)
    assert loss.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in ref]
    assert loss[2].max().item() == pytest.approx(3.0 * 2.0)  # -c A with A = -2
    assert m["dual_clip_frac"] > 0
    with pytest.raises(ValueError, match="dual_clip_c"):
        get_policy_loss("dual_clip")(big, OLD, ADV, MASK, LossParams(0.2, 0.2, 1.0))


def gspo_sequence_objective(lp, old, adv, mask, lo, hi):
    """GSPO eq. 5-7 written at sequence level: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)."""
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    return -torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv).mean()


@pytest.mark.parametrize("lo, hi", [(3e-4, 4e-4), (0.5, 0.5)])
def test_gspo_token_form_equals_sequence_objective_value_and_gradient(lo, hi):
    lp = (OLD + torch.randn(B, T) * 0.05).requires_grad_()
    loss_tok, _ = get_policy_loss("gspo")(lp, OLD, ADV, MASK, LossParams(lo, hi))
    loss = aggregate(loss_tok, MASK, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = lp.detach().clone().requires_grad_()
    ref = gspo_sequence_objective(lp2, OLD, ADV, MASK, lo, hi)
    (ref_grad,) = torch.autograd.grad(ref, lp2)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(grad * MASK, ref_grad * MASK, atol=1e-6)
    # every token of a sequence carries that sequence's clipped objective
    s = torch.exp(((lp - OLD) * MASK).sum(-1) / MASK.sum(-1)).detach()
    per_seq = -torch.minimum(s * ADV, s.clamp(1 - lo, 1 + hi) * ADV)
    on = MASK > 0
    assert torch.allclose(loss_tok.detach()[on], per_seq[:, None].expand(-1, T)[on], atol=1e-6)


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo"])
def test_gradient_flows_only_through_current_logprobs(name):
    lp = NEW.clone().requires_grad_()
    old = OLD.clone().requires_grad_()
    adv = ADV.clone().requires_grad_()
    loss, _ = get_policy_loss(name)(lp, old, adv, MASK, LossParams(0.2, 0.2))
    aggregate(loss, MASK).backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert old.grad is None and adv.grad is None
    assert (lp.grad * (1 - MASK)).abs().max() == 0  # padding gets no gradient


def test_aggregations_by_hand():
    loss = torch.arange(B * T, dtype=torch.float).reshape(B, T)
    per_seq_sum = (loss * MASK).sum(-1)
    lengths = MASK.sum(-1)  # [3, 6, 2, 3]
    assert per_seq_sum.tolist() == [3.0, 51.0, 25.0, 60.0]  # 0+1+2, 6+..+11, 12+13, 19+20+21
    assert aggregate(loss, MASK, "token-mean").item() == pytest.approx(139 / 14)
    assert aggregate(loss, MASK, "seq-mean-token-mean").item() == pytest.approx(
        (3 / 3 + 51 / 6 + 25 / 2 + 60 / 3) / 4)
    assert aggregate(loss, MASK, "seq-mean-token-sum-norm", norm_length=8).item() == \
        pytest.approx(139 / (4 * 8))
    assert lengths.tolist() == [3, 6, 2, 3]
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(loss, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="train.loss_agg.*token-mean"):
        aggregate(loss, MASK, "bogus")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_losses_sum_to_the_full_batch_loss(mode):
    loss = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    full = aggregate(loss, MASK, mode, norm_length=6)
    n_tok, n_seq = MASK.sum(), (MASK.sum(-1) > 0).sum()
    parts = sum(aggregate(loss[i:i + 1], MASK[i:i + 1], mode, num_tokens=n_tok,
                          num_seqs=n_seq, norm_length=6) for i in range(B))
    # float32 sums in another order: rounding relative to the terms, not to a total near 0
    assert parts.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-6 * loss.abs().max().item())


def test_sequences_without_trained_tokens_do_not_count():
    mask = MASK.clone()
    mask[1] = 0
    loss = torch.ones(B, T)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(1.0)
    assert aggregate(loss, torch.zeros(B, T), "token-mean").item() == 0.0


def test_kl_estimators_closed_form_and_exact_expectations():
    lp = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    ref = torch.log(torch.tensor([0.2, 0.3, 0.5]))
    d = ref - lp
    assert torch.allclose(kl_k1(lp, ref), -d)
    assert torch.allclose(kl_k2(lp, ref), d ** 2 / 2)
    assert torch.allclose(kl_k3(lp, ref), d.exp() - d - 1)
    true_kl = float((lp.exp() * (lp - ref)).sum())
    # k1 and k3 are unbiased: their exact expectation under pi equals KL(pi || ref)
    for k in (kl_k1, kl_k3):
        assert float((lp.exp() * k(lp, ref)).sum()) == pytest.approx(true_kl, rel=1e-5)
    assert (kl_k3(lp, ref) >= 0).all() and (kl_k2(lp, ref) >= 0).all()
    assert set(registry.names("kl")) == {"k1", "k2", "k3"}


def test_kl_gradient_flows_only_through_current_logprobs():
    lp = torch.randn(3).requires_grad_()
    ref = torch.randn(3).requires_grad_()
    for k in (kl_k1, kl_k2, kl_k3):
        k(lp, ref).sum().backward()
    assert ref.grad is None and lp.grad is not None
