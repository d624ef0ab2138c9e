"""sample() (the engine's fast path) against the reference pure functions, and the sampled
distribution against its definition."""

import random

import pytest
import torch

from rollwise.engine.sampling import SamplingParams, draw, entropy, sample, sampling_logprobs

SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (0.0, 0, 1.0),
            (0.0, 3, 0.5)]


def params_for(setting):
    temperature, top_k, top_p = setting
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def reference(logits, params, u):
    t = torch.tensor([p.temperature for p in params])
    logp = sampling_logprobs(logits, t, torch.tensor([p.top_k for p in params]),
                             torch.tensor([p.top_p for p in params]))
    tokens = draw(logp, torch.tensor(u, dtype=torch.float64), t == 0)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), entropy(logp), logp


@pytest.mark.parametrize("setting", SETTINGS)
def test_shared_settings_match_the_reference(setting):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=g) * 3
    params = [params_for(setting)] * 64
    u = [random.Random(i).random() for i in range(64)]
    for got, ref in zip(sample(logits, params, u), reference(logits, params, u)):
        assert torch.allclose(got.float(), ref.float(), atol=1e-6)


def test_mixed_settings_match_the_reference_row_by_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(60, 30, generator=g) * 2
    params = [params_for(SETTINGS[i % len(SETTINGS)]) for i in range(60)]
    u = [random.Random(i).random() for i in range(60)]
    got, ref = sample(logits, params, u), reference(logits, params, u)
    for a, b in zip(got, ref):
        assert torch.allclose(a.float(), b.float(), atol=1e-6)
    alone = [sample(logits[i:i + 1], params[i:i + 1], u[i:i + 1]) for i in range(60)]
    assert got[0].tolist() == [a[0].item() for a in alone]  # rows do not affect each other


def test_masked_vocabulary_and_bf16_logits_match_the_reference():
    """Logits of -inf (a masked vocabulary) without top-k/top-p, in bf16 as a bf16 engine
    gives them: the one-pass entropy falls back to 0 * log 0 = 0 on those rows only."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 50, generator=g) * 3).to(torch.bfloat16)
    logits[::3, 40:] = float("-inf")
    params = [params_for((1.0, 0, 1.0))] * 16
    u = [random.Random(i).random() for i in range(16)]
    got, ref = sample(logits, params, u), reference(logits, params, u)
    assert torch.isfinite(got[2]).all()
    for a, b in zip(got, ref):
        assert torch.allclose(a.float(), b.float(), atol=1e-6)


def test_a_large_batch_sampled_in_passes_equals_one_pass(monkeypatch):
    """Batches over the pass size are sampled in row passes: the same tokens, log-probs,
    entropies and tables as one pass over every row."""
    from rollwise.engine import sampling
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 40, generator=g) * 3
    params = [params_for(SETTINGS[i % 2]) for i in range(50)]
    u = [random.Random(i).random() for i in range(50)]
    whole = sample(logits, params, u)
    monkeypatch.setattr(sampling, "_PASS_ELEMENTS", 7 * 40)  # passes of 7 rows
    for a, b in zip(sample(logits, params, u), whole):
        assert a.shape == b.shape and torch.equal(a, b)


def test_top_k_top_p_support_and_frequencies():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    _, _, _, logp = sample(logits, [p], [0.5])
    probs = logits.softmax(-1)[0, :3]
    keep = probs / probs.sum()  # top-3, then the smallest prefix reaching 0.9 of that mass
    n = 2 if keep[:2].sum() >= 0.9 else 3
    want = torch.full((5,), float("-inf"))
    want[:n] = (keep[:n] / keep[:n].sum()).log()
    assert torch.allclose(logp[0], want)
    rng = random.Random(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, [p], [rng.random()])[0].item()] += 1
    assert torch.allclose(counts / 4000, want.exp(), atol=0.03)
