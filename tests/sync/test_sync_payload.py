"""SparseRL-Sync payloads: applying the sparse payloads to a copy of the engine's old weights
gives the trainer's weights bit for bit (integer views), for random change masks over k steps;
the changed-index set equals a naive per-element reference; full and sparse agree; the bucket
layout round-trips."""

import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from sync_helpers import change, named, new_sync, push, random_bits_change, same_bits

from rollwise.sync import coding
from rollwise.sync import payload as P


def coded_size(old: torch.Tensor, new: torch.Tensor) -> int:
    mirror = P.bits(old).reshape(-1).clone()
    return coding.scan(P.bits(new).reshape(-1), mirror, torch.int32, limit=2**40)[1][0].numel()


def read_blob(blob: torch.Tensor, head: coding.Coded):
    """A reference reader of the coded format, vectorised torch (the library's is a numba loop):
    -> (ascending indices, differences)."""
    parts, at = [], 0
    for count, dtype in head.sections():
        parts.append(blob[at:at + count * dtype.itemsize].view(dtype) if count
                     else torch.empty(0, dtype=dtype))
        at += (count * dtype.itemsize + 7) // 8 * 8
    gap_bytes, packed, long_gaps, small, large = parts
    gaps = gap_bytes.to(torch.int64)
    gaps[gaps == 0] = long_gaps.to(torch.int64)
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], 1).reshape(-1)[:head.changes]
    diff = 1 - 2 * codes.to(torch.int64)
    diff[codes == 2] = small.to(torch.int64)
    diff[codes == 3] = large.to(torch.int64)
    return gaps.cumsum(0) - 1, diff


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.uint8, torch.int8, torch.float16, torch.int32]),
       n=st.integers(1, 3000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31),
       gap64=st.booleans())
def test_delta_coding_round_trips_any_change(dtype, n, density, seed, gap64):
    """Random bits (every difference size), sparse masks (long gaps): scan codes exactly the
    changed elements, updates the mirror, and apply rebuilds the new bits from the old."""
    old, new = random_bits_change(dtype, n, density, seed)
    width = old.element_size()
    mirror = old.clone()
    gap_dtype = torch.int64 if gap64 else torch.int32
    changes, coded = coding.scan(new, mirror, gap_dtype, 2**40)
    expected = (old != new).nonzero().squeeze(1)
    assert changes == expected.numel() and torch.equal(mirror, new)
    blob, head = coded
    idx, diff = read_blob(blob, head)
    assert torch.equal(idx, expected)
    mod = 2 ** (8 * width)
    assert ((diff - (new[idx].long() - old[idx].long())) % mod == 0).all()
    rebuilt = old.clone()
    coding.apply(rebuilt, blob, head)
    assert torch.equal(rebuilt, new)
    # a limit at or below the blob's size reports the count only, with the mirror still updated
    mirror = old.clone()
    assert coding.scan(new, mirror, gap_dtype, head.nbytes) == (changes, None)
    assert torch.equal(mirror, new)


def test_a_malformed_blob_is_refused_before_any_write():
    old = torch.arange(0, 4000, dtype=torch.int16)
    new = old.clone()
    new[::3] += 1
    new[7] += 90
    new[3000] -= 1000
    blob, head = coding.scan(new, old.clone(), torch.int32, 2**20)[1]
    assert (head.changes, head.small_diffs, head.large_diffs) == (1335, 1, 1)
    cases = {  # what the error says: (tensor, blob, header)
        "past the tensor": (old[:2990].clone(), blob, head),
        "small differences run out": (old.clone(), blob, coding.Coded(
            head.changes, head.long_gaps, 0, head.large_diffs, 2, "int32")),
        "long gaps run out": (old.clone(), blob, coding.Coded(  # reads zero padding as gaps
            head.changes + 1, head.long_gaps, head.small_diffs, head.large_diffs, 2, "int32")),
        "left over": (old.clone(), blob, coding.Coded(
            head.changes, head.long_gaps, head.small_diffs + 1, head.large_diffs, 2, "int32")),
        "4-byte ones": (old.view(torch.int32).clone(), blob, head),
    }
    for why, (target, b, h) in cases.items():
        before = target.clone()
        with pytest.raises(ValueError, match=why):
            coding.apply(target, b, h)
        assert torch.equal(target, before), why


shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       shape_list=st.lists(shapes, min_size=1, max_size=4),
       steps=st.integers(1, 4), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31),
       coding=st.sampled_from(["delta", "pairs"]))
def test_sparse_payloads_reproduce_the_trainer_bit_for_bit(dtype, shape_list, steps, density,
                                                           seed, coding):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    weights = {f"p.t{i}": torch.randn(s).to(dtype) for i, s in enumerate(shape_list)}
    engine, receiver, sender = new_sync(weights, coding=coding)
    push(sender, receiver, weights, 0, full=True)
    old = {n: t.clone() for n, t in named(engine).items()}
    for _ in range(steps):  # k optimizer steps between two syncs: their index sets are united
        weights = {n: change(t, rng.random(t.numel()) < density, rng) for n, t in weights.items()}
    meta, arena = push(sender, receiver, weights, steps)
    got = named(engine)
    for n, w in weights.items():
        assert same_bits(got[n], w)
    # the carried indices are exactly the elements whose stored bits differ (naive reference)
    views = P.entry_views(meta, arena)
    entries = {e.name: e for e in meta.entries}
    for name, w in weights.items():
        a = P.bits(old[name]).reshape(-1).numpy()
        b = P.bits(w).reshape(-1).numpy()
        expected = [j for j in range(a.size) if a[j] != b[j]]
        if not expected:
            assert name not in views  # unchanged tensors are dropped
            continue
        values, indices = views[name]
        if coding == "delta":  # coded where smaller than the tensor, else whole
            if entries[name].coded is None:
                assert same_bits(values, w.reshape(-1))
                assert coded_size(old[name], w) >= w.numel() * w.element_size()
            else:
                idx, diff = read_blob(values, entries[name].coded)
                assert idx.tolist() == expected
                assert values.numel() < w.numel() * w.element_size()
                naive = [(int(b[j]) - int(a[j])) % 2**(8 * w.element_size()) for j in expected]
                assert [d % 2**(8 * w.element_size()) for d in diff.tolist()] == naive
        elif indices is None:  # denser than break-even: sent whole
            assert not P.sparse_wins(len(expected), w.numel(), w.element_size(), 4)
            assert same_bits(values, w.reshape(-1))
        else:
            assert indices.tolist() == expected and indices.dtype == torch.int32
            assert P.sparse_wins(len(expected), w.numel(), w.element_size(), 4)
    assert meta.changed == sum(int((P.bits(old[n]) != P.bits(w)).sum())
                               for n, w in weights.items())
    assert engine.version == steps


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), density=st.floats(0.0, 0.5))
def test_full_and_sparse_payloads_agree(seed, density):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    w0 = {"p.a": torch.randn(33, 17).bfloat16(), "p.b": torch.randn(300).bfloat16()}
    e_sparse, r_sparse, s_sparse = new_sync(w0)
    e_full, r_full, s_full = new_sync(w0)
    push(s_sparse, r_sparse, w0, 0)
    w1 = {n: change(t, rng.random(t.numel()) < density, rng) for n, t in w0.items()}
    m_sparse, _ = push(s_sparse, r_sparse, w1, 1)
    m_full, _ = push(s_full, r_full, w1, 1, full=True)
    assert m_sparse.kind == "sparse" and m_full.kind == "full"
    assert m_sparse.checksums == m_full.checksums
    for n, t in named(e_full).items():
        assert same_bits(named(e_sparse)[n], t)


def test_bucket_layout_is_padded_aligned_and_split_by_size():
    items = [P.Item(f"w{i}", "bfloat16", 1000, False) for i in range(5)]
    items += [P.Item("s", "float32", 10, True, "int32"), P.Item("e", "bfloat16", 0, True, "int32")]
    meta = P.plan(items, kind="sparse", sender="x", base_version=0, version=1,
                  bucket_bytes=2500 * 2)
    meta = pickle.loads(pickle.dumps(meta))
    assert [e.name for e in meta.entries] == ["w0", "w1", "w2", "w3", "w4", "s"]  # empty dropped
    dense = [b for b in meta.buckets if b.index_dtype is None]
    assert [b.count for b in dense] == [2000, 2000, 1000]  # closed before passing 2500 elements
    for b in meta.buckets:
        assert b.padded % P.PAD == 0 and b.padded >= b.count
        assert b.values_at % 256 == 0 and (b.indices_at is None or b.indices_at % 256 == 0)
    assert meta.nbytes == sum(b.nbytes for b in meta.buckets)
    arena = torch.arange(meta.nbytes, dtype=torch.int64).to(torch.uint8)
    views = P.entry_views(meta, arena)
    assert views["w3"][0].numel() == 1000 and views["s"][1].dtype == torch.int32
    # regions do not overlap: write a distinct value per tensor, read each back
    for k, (v, _) in enumerate(views.values()):
        v.fill_(k + 1)
    assert [int(v[0]) for v, _ in views.values()] == list(range(1, 7))


def test_tensors_over_the_int32_limit_get_int64_indices(monkeypatch):
    assert P.index_dtype(2**31 - 1) == torch.int32 and P.index_dtype(2**31) == torch.int64
    monkeypatch.setattr(P, "INT32_MAX", 50)  # stands for 2**31 - 1 without 4 GiB tensors
    w0 = {"p.small": torch.zeros(40), "p.big": torch.zeros(200)}
    engine, receiver, sender = new_sync(w0, coding="pairs")
    push(sender, receiver, w0, 0)
    w1 = {n: t.clone() for n, t in w0.items()}
    w1["p.small"][[3, 7]] = 1.0
    w1["p.big"][[0, 199]] = 2.0
    meta, arena = push(sender, receiver, w1, 1)
    views = P.entry_views(meta, arena)
    assert views["p.small"][1].dtype == torch.int32
    assert views["p.big"][1].dtype == torch.int64 and views["p.big"][1].tolist() == [0, 199]
    assert same_bits(named(engine)["p.big"], w1["p.big"])


def test_tied_weights_travel_once(tiny):
    import copy
    model, _ = tiny
    engine_model = copy.deepcopy(model)
    sd = engine_model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    unique = P.unique_tensors(sd)
    assert "model.embed_tokens.weight" in unique and "lm_head.weight" not in unique
    assert len(unique) == len(sd) - 1
