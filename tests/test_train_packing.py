"""Shared-prompt packing: one row per prompt with its responses after it must give the padded
forward pass's log-probabilities, entropies and gradients (float rounding only), in any order of
samples, with rows capped, and a model whose attention ignores the packing mask is caught."""

import copy
import random

import pytest
import torch

from rollwise.config import TrainConfig
from rollwise.training.packing import pack, packed_token_logprobs, worth_packing
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch, Sample
from train_helpers import capture_grads, clone, make_groups


def random_samples(seed: int, prompts: int = 5, vocab=(3, 50)) -> list[Sample]:
    """Groups of 1-6 samples sharing a random prompt; responses of 0-7 tokens; shuffled."""
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(*vocab) for _ in range(rng.randint(1, 12))]
        for _ in range(rng.randint(1, 6)):
            resp = [rng.randrange(*vocab) for _ in range(rng.randint(0, 7))]
            out.append(Sample(prompt_id=str(g), prompt_ids=prompt, response_ids=resp,
                              logprobs=[0.0] * len(resp), versions=[0] * len(resp),
                              loss_mask=[1] * len(resp)))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [2048, 10])
@pytest.mark.parametrize("fill", [False, True])
def test_packed_logprobs_and_entropies_equal_the_padded_pass(tiny, seed, cap, fill):
    model, tok = tiny
    samples = random_samples(seed)
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    packed = pack(batch, max_row_tokens=cap, fill=fill)
    assert packed.input_ids.shape[1] <= max(cap, int(batch.attention_mask.sum(1).max()))
    with torch.no_grad():
        ref_lp, ref_ent = token_logprobs(model, batch)
        lp, ent = packed_token_logprobs(model, batch, packed)
    m = batch.loss_mask > 0
    assert int(m.sum()) == packed.target.numel()  # every response target, once
    assert (lp[m] - ref_lp[m]).abs().max() < 1e-5
    assert (ent[m] - ref_ent[m]).abs().max() < 1e-5
    assert (lp[~m] == 0).all()
    if cap == 2048 and not fill:  # one row per distinct prompt: the prompt is computed once
        assert packed.input_ids.shape[0] == len({tuple(s.prompt_ids) for s in samples})
        assert packed.tokens < batch.input_ids.numel()


def test_packed_gradient_equals_the_padded_gradient(tiny):
    model, tok = tiny
    samples = random_samples(7)
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for packed in (False, True):
        m = copy.deepcopy(model)
        lp, ent = (packed_token_logprobs(m, batch, pack(batch, fill=True), entropy_grad=True)
                   if packed
                   else token_logprobs(m, batch, entropy_grad=True))
        ((lp + 0.1 * ent) * weights * batch.loss_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    scale = grads[0].abs().max()
    assert scale > 0 and (grads[0] - grads[1]).abs().max() <= 1e-5 * scale


def test_packing_is_used_only_where_it_saves_tokens(tiny):
    model, tok = tiny
    distinct = [Sample(prompt_id=str(i), prompt_ids=[5 + i, 6], response_ids=[7, 8, 9],
                       logprobs=[0.0] * 3, versions=[0] * 3, loss_mask=[1] * 3)
                for i in range(4)]  # no prompt shared: packing saves nothing
    batch = Batch.from_samples(distinct, [0.0] * 4, tok.pad_token_id)
    assert not worth_packing(batch, pack(batch))


def test_trainer_update_is_the_same_packed_or_padded(tiny):
    """A whole update (prepare + two minibatch steps) with and without packing: the same
    gradients at every optimizer step, up to float rounding."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=4, group_size=4, max_new_tokens=6, seed=11)
    grads = []
    for packed in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2, pack_prompts=packed),
                          pad_id=tok.pad_token_id, seed=2)
        seen = capture_grads(trainer)
        trainer.update(clone(groups))
        assert trainer._pack is packed
        grads.append([torch.cat([g.flatten() for g in step]) for step in seen])
    for a, b in zip(*grads):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_a_model_that_ignores_the_packing_mask_is_trained_unpacked(tiny):
    """Packing relies on the model honouring a 4D attention mask and position ids; the first
    update checks it against the padded pass and turns packing off, with a warning."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)
    broken = copy.deepcopy(model)
    forward = broken.forward

    def ignores_mask(*args, **kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            kwargs["attention_mask"] = None  # sees every token, as a careless model would
        return forward(*args, **kwargs)
    broken.forward = ignores_mask
    trainer = Trainer(broken, TrainConfig(minibatches=1), pad_id=tok.pad_token_id)
    with pytest.warns(RuntimeWarning, match="pack_prompts"):
        trainer.update(clone(groups))
    assert trainer._pack is False


def _with_columns(seed: int) -> list[Sample]:
    """random_samples with random behaviour logprobs, versions, loss masks and (for some
    samples) engine entropies."""
    rng = random.Random(seed)
    out = random_samples(seed)
    for s in out:
        n = s.num_tokens
        s.logprobs = [rng.gauss(-1, 1) for _ in range(n)]
        s.versions = [rng.randrange(4) for _ in range(n)]
        s.loss_mask = [rng.randrange(2) for _ in range(n)]
        s.entropies = [rng.random() for _ in range(n)] if rng.random() < 0.7 else []
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batch_columns_equal_a_per_sample_layout(seed):
    """Batch.from_samples (vectorised) against the layout written out sample by sample."""
    samples = _with_columns(seed)
    batch = Batch.from_samples(samples, [0.5] * len(samples), pad_id=1)
    T = max(len(s.prompt_ids) + s.num_tokens for s in samples)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), s.num_tokens
        seq = s.prompt_ids + s.response_ids
        assert batch.input_ids[i].tolist() == seq + [1] * (T - p - n)
        assert batch.attention_mask[i].tolist() == [1] * (p + n) + [0] * (T - p - n)

        def col(values, fill):  # response token j is the target of column p - 1 + j
            return [fill] * (p - 1) + list(values) + [fill] * (T - p - n)
        assert batch.loss_mask[i].tolist() == col(map(float, s.loss_mask), 0.0)
        assert torch.equal(batch.behaviour_logprobs[i],
                           torch.tensor(col(s.logprobs, 0.0), dtype=torch.float))
        assert batch.versions[i].tolist() == col(s.versions, -1)
        assert torch.equal(batch.entropies[i], torch.tensor(
            col(s.entropies if len(s.entropies) == n else [0.0] * n, 0.0), dtype=torch.float))
        assert int(batch.prompt_lens[i]) == p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [2048, 10, 1])
def test_pack_layout_equals_a_row_by_row_reference(seed, cap):
    """pack (vectorised) against the layout built row by row in plain Python: same rows,
    tokens, positions, mask, and response targets in the same order (row, sample, token)."""
    samples = random_samples(seed)
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=1)
    packed = pack(batch, max_row_tokens=cap)
    rows, keys = [], {}  # [prompt, [sample indices], tokens]
    for i, s in enumerate(samples):
        r = keys.get(tuple(s.prompt_ids))
        if r is None or rows[r][2] + s.num_tokens > cap:
            r = keys[tuple(s.prompt_ids)] = len(rows)
            rows.append([s.prompt_ids, [], len(s.prompt_ids)])
        rows[r][1].append(i)
        rows[r][2] += s.num_tokens
    L = max(t for _, _, t in rows)
    ids, pos, seg, targets = [], [], [], []
    for r, (prompt, members, _) in enumerate(rows):
        P = len(prompt)
        tok, ps, sg = list(prompt), list(range(P)), [0] * P
        for k, i in enumerate(members):
            resp = samples[i].response_ids
            for j, t in enumerate(resp):
                targets.append((r, P - 1 if j == 0 else len(tok) - 1, t, i, P - 1 + j))
                tok.append(t)
                ps.append(P + j)
                sg.append(k + 1)
        ids.append(tok + [0] * (L - len(tok)))
        pos.append(ps + [0] * (L - len(ps)))
        seg.append(sg + [-1] * (L - len(sg)))
    assert packed.input_ids.tolist() == ids and packed.position_ids.tolist() == pos
    got = list(zip(*(x.tolist() for x in (packed.src_row, packed.src_pos, packed.target,
                                           packed.dst_row, packed.dst_col))))
    assert got == targets
    for r in range(len(rows)):
        for q in range(L):
            for k in range(L):
                may = (k <= q and seg[r][k] != -1 and seg[r][q] != -1
                       and seg[r][k] in (0, seg[r][q])) or k == q
                assert bool(packed.mask[r, 0, q, k]) == may
