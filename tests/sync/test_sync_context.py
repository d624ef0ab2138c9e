"""Context coding of sparse weight-sync payloads (rollwise.sync.context_coding): any change
round-trips bit for bit; the blob is what a plain-Python reading of the documented format
gives; its size on a constructed tensor is the closed form; a malformed blob is refused before
any write; a context-coded sync reproduces the trainer's weights."""

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from sync_helpers import change, named, new_sync, push, random_bits_change, same_bits

from rollwise.sync import context_coding as C
from rollwise.sync import payload as P


def reference_decode(old: torch.Tensor, blob: torch.Tensor, head: C.ContextCoded) -> dict:
    """{index: new bits} read from the blob by the module docstring's format, element by
    element in plain Python."""
    raw = blob.numpy().tobytes()
    bits = "".join(f"{b:08b}" for b in raw)
    mask, shift = C.group_bits(head.width)
    mod = 2 ** (8 * head.width)
    rows = np.frombuffer(raw[:head.groups * 16], np.uint32).reshape(-1, 4)
    streams, at = {}, head.groups * 16 * 8
    for g, c, kj, size in rows.tolist():
        streams[g] = {"pos": at, "left": c, "k": kj & 0xFF, "j": kj >> 8}
        at += size * 8

    def rice(s, k):
        q = 0
        while q < C.ESCAPE and bits[s["pos"]] == "1":
            q, s["pos"] = q + 1, s["pos"] + 1
        if q == C.ESCAPE:
            v, s["pos"] = int(bits[s["pos"]:s["pos"] + 64], 2), s["pos"] + 64
            return v
        s["pos"] += 1  # the zero
        r = int(bits[s["pos"]:s["pos"] + k] or "0", 2)
        s["pos"] += k
        return (q << k) | r

    for s in streams.values():
        s["next"], s["seen"] = rice(s, s["k"]), 0
    out = {}
    for i, a in enumerate(old.tolist()):
        s = streams.get((a & mask) >> shift)
        if s is None:
            continue
        if s["left"] and s["seen"] == s["next"]:
            if s["j"] == C.SIGN_ONLY:
                d = -1 if bits[s["pos"]] == "1" else 1
                s["pos"] += 1
            else:
                z = rice(s, s["j"])
                d = -(z // 2 + 1) if z & 1 else z // 2 + 1
            v = (a + d) % mod
            out[i] = v - mod if v >= mod // 2 else v
            s["left"] -= 1
            if s["left"]:
                s["next"] = s["seen"] + 1 + rice(s, s["k"])
        s["seen"] += 1
    return out


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.uint8, torch.int8, torch.bfloat16, torch.float16,
                              torch.float32]),
       n=st.integers(1, 2000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_context_coding_round_trips_any_change(dtype, n, density, seed):
    """Random bits (every exponent, every difference size: sign flips, NaNs, escapes), nudges of
    one unit in the last place: scan codes exactly the changed elements, updates the mirror,
    and apply (and the plain-Python reading) rebuild the new bits from the old."""
    old, new = random_bits_change(dtype, n, density, seed)
    width = old.element_size()
    mirror = old.clone()
    changes, coded = C.scan(new, mirror, 2**40)
    expected = (old != new).nonzero().squeeze(1)
    assert changes == expected.numel() and torch.equal(mirror, new)
    if changes == 0:
        assert coded is None
        return
    blob, head = coded
    assert head.changes == changes and blob.numel() == head.nbytes
    ref = reference_decode(old, blob, head)
    assert sorted(ref) == expected.tolist()
    mod = 2 ** (8 * width)  # the reference reads signed bits; uint8 views are unsigned
    assert all((ref[i] - int(new[i])) % mod == 0 for i in ref)
    rebuilt = old.clone()
    C.apply(rebuilt, blob, head)
    assert torch.equal(rebuilt, new)
    mirror = old.clone()  # a limit at the blob's size: the count only, the mirror updated
    assert C.scan(new, mirror, head.nbytes) == (changes, None)
    assert torch.equal(mirror, new)


def test_one_group_of_one_unit_steps_costs_two_bits_a_change():
    """bf16: 3000 weights near 1e-4 (one exponent), every one moved by +-1 unit in the last
    place, among 5000 near 0.05 (another exponent) left alone. The changed group's gaps are
    all 1 (Rice k = 0: one bit) and its differences all +-1 (one bit): the blob is one table
    row and 2 bits per change, where the delta coding spends 10."""
    small = torch.full((3000,), 1.0e-4).to(torch.bfloat16)
    big = torch.full((5000,), 0.05).to(torch.bfloat16)
    old = P.bits(torch.cat([big[:2000], small, big[2000:]]))
    signs = torch.tensor([1, -1], dtype=torch.int16).repeat(1500)
    new = old.clone()
    new[2000:5000] += signs
    changes, (blob, head) = C.scan(new, old.clone(), 2**40)
    assert (changes, head.groups) == (3000, 1)
    assert head.nbytes == C.GROUP_FIELDS * 4 + 2 * 3000 // 8
    row = np.frombuffer(blob.numpy().tobytes()[:16], np.uint32)
    assert row.tolist() == [(int(old[2000]) & 0x7FFF) >> 7, 3000, C.SIGN_ONLY << 8, 750]


def test_a_malformed_blob_is_refused_before_any_write():
    old = P.bits((torch.arange(1, 4001) * 1e-3).to(torch.bfloat16))
    new = old.clone()
    new[::3] += 1
    new[7] += 90
    blob, head = C.scan(new, old.clone(), 2**20)[1]
    twice, empty = blob.clone(), blob.clone()
    twice[16:20] = twice[0:4]  # the second row names the first row's group
    empty[12:16] = 0  # the first group's stream holds no bytes
    cases = {  # what the error says: (tensor, blob, header)
        "runs past the blob": (old.clone(), blob[:head.nbytes // 2].clone(),
                               C.ContextCoded(head.changes, head.groups, 2, head.nbytes // 2)),
        "runs out": (old.clone(), empty, head),
        "differ from its table": (old.clone(), blob, C.ContextCoded(
            head.changes + 1, head.groups, 2, head.nbytes)),
        "more changes than": (old[:3000].clone(), blob, head),
        "named twice": (old.clone(), twice, head),
        "holds": (old.clone(), blob[:10].clone(), head),
        "4-byte ones": (old[:4000].view(torch.int32).clone(), blob, head),
    }
    for why, (target, b, h) in cases.items():
        before = target.clone()
        with pytest.raises(ValueError, match=why):
            C.apply(target, b, h)
        assert torch.equal(target, before), why


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       steps=st.integers(1, 3), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_context_coded_syncs_reproduce_the_trainer_bit_for_bit(dtype, sizes, steps, density,
                                                               seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    weights = {f"p.t{i}": (0.02 * torch.randn(s)).to(dtype) for i, s in enumerate(sizes)}
    engine, receiver, sender = new_sync(weights, coding="context")
    push(sender, receiver, weights, 0, full=True)
    old = {n: t.clone() for n, t in named(engine).items()}
    for _ in range(steps):
        weights = {n: change(t, rng.random(t.numel()) < density, rng) for n, t in weights.items()}
    meta, _ = push(sender, receiver, weights, steps)
    got = named(engine)
    assert all(same_bits(got[n], w) for n, w in weights.items())
    for e in meta.entries:  # coded only where smaller than the tensor, else whole
        w = weights[e.name]
        if e.coded is not None:
            assert isinstance(e.coded, C.ContextCoded) and e.count < w.numel() * w.element_size()
            assert e.coded.changes == int((P.bits(old[e.name]) != P.bits(w)).sum())
    assert meta.changed == sum(int((P.bits(old[n]) != P.bits(w)).sum())
                               for n, w in weights.items())
    assert engine.version == steps
