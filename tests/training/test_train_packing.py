"""Shared-prefix packing: one trie per prompt (its responses, and tree children's shared
response prefixes, once) must give the padded forward pass's log-probabilities, entropies and
gradients (float rounding only), in any order of samples, with rows capped, and a model whose
attention ignores the packing mask is caught."""

import copy
import random

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups, random_samples

from rollwise.config import TrainConfig
from rollwise.training import packed_attention
from rollwise.training.packing import pack, packed_token_logprobs, worth_packing
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch, Sample


def attending(model, attention: str):
    """A copy of the model attending packed rows by segments or through the dense mask."""
    model = copy.deepcopy(model)
    if attention == "segments":
        assert packed_attention.enable(model)
    return model


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [2048, 10])
@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_packed_logprobs_and_entropies_equal_the_padded_pass(tiny, seed, cap, fill, attention):
    model, tok = tiny
    model = attending(model, attention)
    samples = _tree_samples(seed)  # groups, and tree children sharing response prefixes
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


@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_packed_gradient_equals_the_padded_gradient(tiny, attention):
    model, tok = tiny
    model = attending(model, attention)
    samples = _tree_samples(7)
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


@pytest.mark.parametrize("attention", ["segments", "mask", "auto"])
def test_trainer_update_is_the_same_packed_or_padded(tiny, attention):
    """A whole update (prepare + two minibatch steps) with and without packing: the same
    gradients at every optimizer step, up to float rounding."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=4, group_size=4, max_new_tokens=6, seed=11)
    grads = []
    for packed in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=2, pack_prompts=packed,
                                                            packed_attention=attention),
                          pad_id=tok.pad_token_id, seed=2)
        seen = capture_grads(trainer)
        trainer.update(clone(groups))
        assert trainer._pack is packed
        assert trainer._segments is (packed and attention != "mask")
        grads.append([torch.cat([g.flatten() for g in step]) for step in seen])
    for a, b in zip(*grads):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-5 * a.abs().max()


def careless(model, drops_layout: bool):
    """The model, ignoring 4D attention masks (it sees every token, as a careless model
    would) and, with drops_layout, the keyword arguments it does not know."""
    broken = copy.deepcopy(model)
    forward = broken.forward

    def ignores_mask(*args, **kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            kwargs["attention_mask"] = None
        if drops_layout:
            kwargs.pop("packed_layout", None)
        return forward(*args, **kwargs)
    broken.forward = ignores_mask
    return broken


def test_a_model_that_ignores_the_packing_mask_and_layout_is_trained_unpacked(tiny):
    """Packing relies on the model honouring the packed layout or a 4D attention mask, and
    position ids; the first update checks it against the padded pass and turns packing off,
    with a warning."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)
    broken = careless(model, drops_layout=True)
    trainer = Trainer(broken, TrainConfig(minibatches=1, packed_attention="segments"),
                      pad_id=tok.pad_token_id)
    with pytest.warns(RuntimeWarning) as said:
        trainer.update(clone(groups))
    assert [w for w in said if "packed_attention=segments" in str(w.message)]
    assert [w for w in said if "pack_prompts:" in str(w.message)]
    assert trainer._pack is False and trainer._segments is False
    assert broken.config._attn_implementation == "sdpa"  # switched back


def test_segments_need_no_mask_and_keep_packing_where_the_mask_is_ignored(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)
    trainer = Trainer(careless(model, drops_layout=False),
                      TrainConfig(minibatches=1, packed_attention="segments"),
                      pad_id=tok.pad_token_id)
    trainer.update(clone(groups))
    assert trainer._pack is True and trainer._segments is True


def test_packed_attention_builds_no_dense_mask(tiny, monkeypatch):
    model, tok = attending(tiny[0], "segments"), tiny[1]
    batch = Batch.from_samples(_tree_samples(2), [0.0] * 12, tok.pad_token_id)
    packed = pack(batch, fill=True)
    reference = packed_token_logprobs(attending(tiny[0], "mask"), batch, packed)[0]
    monkeypatch.setattr(packed, "dense", lambda: pytest.fail("the dense mask was built"))
    with torch.no_grad():
        got = packed_token_logprobs(model, batch, packed)[0]
    assert (got - reference).abs().max() < 1e-5


@pytest.mark.parametrize("group, prompt, lengths", [(8, 30, (5, 60)), (3, 2, (1, 3)),
                                                    (1, 12, (40, 40))])
def test_segments_equal_each_sequence_run_alone_on_a_chat_model(tmp_path, group, prompt,
                                                                 lengths):
    """Prompts of a chat model (GQA: 4 query heads on 2 key/value heads) with responses of
    spread lengths: each response token's log-probability from the packed rows equals the
    sequence's own forward pass, with no other sequence in it."""
    from chat_model import build_chat_model

    from rollwise import models
    model, tok = models.load_model(build_chat_model(tmp_path / "chat"), "float32")
    packed_model = attending(model, "segments")
    rng = random.Random(group)
    samples = []
    for p in range(3):
        ids = [rng.randrange(5, len(tok)) for _ in range(prompt + p)]
        for _ in range(group):
            n = rng.randint(*lengths)
            samples.append(Sample(prompt_id=str(p), prompt_ids=ids,
                                  response_ids=[rng.randrange(5, len(tok)) for _ in range(n)],
                                  logprobs=[0.0] * n, versions=[0] * n, loss_mask=[1] * n))
    batch = Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        lp = packed_token_logprobs(packed_model, batch, pack(batch, fill=True))[0]
        for i, s in enumerate(samples):
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            alone = model(input_ids=seq).logits[0, :-1].log_softmax(-1)
            want = alone.gather(-1, seq[0, 1:, None])[:, 0][len(s.prompt_ids) - 1:]
            got = lp[i, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + s.num_tokens]
            assert (got - want).abs().max() < 1e-5


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


def _tree_samples(seed: int) -> list[Sample]:
    """random_samples plus tree children: copies of a sample's first k response tokens that
    continue differently (what a fork leaves in a group)."""
    rng = random.Random(seed)
    out = random_samples(seed)
    for s in list(out):
        if s.num_tokens >= 2 and rng.random() < 0.6:
            k = rng.randrange(1, s.num_tokens)
            resp = s.response_ids[:k] + [rng.randrange(3, 50) for _ in range(rng.randint(0, 5))]
            out.append(Sample(prompt_id=s.prompt_id, prompt_ids=s.prompt_ids, response_ids=resp,
                              logprobs=[0.0] * len(resp), versions=[0] * len(resp),
                              loss_mask=[1] * len(resp)))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [2048, 10, 1])
@pytest.mark.parametrize("fill", [False, True])
def test_pack_layout_is_a_prefix_trie_against_a_direct_reading(seed, cap, fill):
    """Read the packed rows back in plain Python: every response target's predicting node sees,
    through the mask, exactly the sample's tokens before it at positions 0.. in order; without a
    row cap each distinct prefix of a prompt's samples is in the rows once; targets come sample
    by sample, in token order."""
    samples = _tree_samples(seed)
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=1)
    packed = pack(batch, max_row_tokens=cap, fill=fill)
    ids, pos, mask = packed.input_ids.tolist(), packed.position_ids.tolist(), packed.mask[:, 0]

    def context(r: int, q: int) -> list[tuple[int, int]]:  # (position id, token) seen by q
        return sorted((pos[r][k], ids[r][k]) for k in range(len(ids[r])) if mask[r, q, k])
    targets = list(zip(*(x.tolist() for x in (packed.src_row, packed.src_pos, packed.target,
                                               packed.dst_row, packed.dst_col))))
    assert len(targets) == sum(s.num_tokens for s in samples)
    for r, q, t, i, col in targets:
        seq = samples[i].prompt_ids + samples[i].response_ids
        assert t == seq[col + 1]
        assert context(r, q) == list(enumerate(seq[:col + 1]))
    order = [(i, col) for _, _, _, i, col in targets]
    for a, b in zip(order, order[1:]):
        assert a[0] != b[0] or b[1] == a[1] + 1  # a sample's targets in order, together
    assert len({i for i, _ in order}) == len({i for i, _ in dict.fromkeys(order)})
    if cap == 2048:  # each distinct context once (the prompt's block has all its samples)
        prefixes = {tuple((s.prompt_ids + s.response_ids)[:d]) for s in samples
                    if s.num_tokens for d in range(1, len(s.prompt_ids) + s.num_tokens)}
        assert len(_real_nodes(packed)) == len(prefixes)


def _real_nodes(packed) -> set[tuple[int, int]]:
    """(row, column) of the nodes some target's context passes through."""
    out = set()
    for r, q in zip(packed.src_row.tolist(), packed.src_pos.tolist()):
        out.update((r, int(k)) for k in torch.nonzero(packed.mask[r, 0, q]).flatten())
    return out


def test_segments_asked_of_a_model_that_does_not_attend_by_sdpa_warn_and_use_the_mask(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    trainer = Trainer(eager, TrainConfig(minibatches=1, packed_attention="segments"),
                      pad_id=tok.pad_token_id)
    with pytest.warns(RuntimeWarning, match="attends with eager, not SDPA"):
        trainer.update(clone(groups))
    assert trainer._pack is True and trainer._segments is False
    assert eager.config._attn_implementation == "eager"


def test_a_switched_models_config_is_shipped_to_other_processes_as_sdpa(tiny):
    """Engine workers and FSDP2 ranks rebuild the model from its config in processes that
    have not registered packed attention: the config they get attends by SDPA, and the
    trainer's own model keeps attending by segments."""
    from transformers import AutoModelForCausalLM
    model = attending(tiny[0], "segments")
    shipped = packed_attention.portable(model.config)
    assert shipped._attn_implementation == "sdpa"
    assert model.config._attn_implementation == packed_attention.ATTN_NAME
    rebuilt = AutoModelForCausalLM.from_config(shipped)
    assert rebuilt.config._attn_implementation == "sdpa"
    plain = copy.deepcopy(tiny[0]).config
    assert packed_attention.portable(plain) is plain  # nothing to change, nothing copied
