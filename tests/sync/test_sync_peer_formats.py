"""The peers' delta weight-sync formats that `rollwise bench sync` measures against
rollwise's: each decodes to the new bf16 weights bit for bit, and their sizes are what the
formats say (verl: 4 + 2 bytes per changed value; XOR + zstd: a compressed stream that is
small when little changed)."""

import pytest
import torch

from rollwise.sync.peer_formats import bits, codecs, positions_encode


def _weights_and_update(density: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(17, generator=g)}
    new = {}
    for k, v in old.items():  # move a share of the values by more than a bf16 step
        mask = torch.rand(v.shape, generator=g) < density
        new[k] = torch.where(mask, v * 1.05 + 0.01, v)
    return old, new


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_every_peer_format_decodes_bit_exactly(density):
    old, new = _weights_and_update(density)
    ob, nb = bits(old), bits(new)
    for name, (encode, decode) in codecs().items():
        payload, _ = encode(ob, nb)
        got = decode(ob, payload)
        assert all(torch.equal(got[k], nb[k]) for k in nb), name


def test_positions_cost_six_bytes_per_changed_bf16_value():
    old, new = _weights_and_update(0.05)
    ob, nb = bits(old), bits(new)
    changed = sum(int((ob[k] != nb[k]).sum()) for k in ob)
    _, nbytes = positions_encode(ob, nb)
    assert changed > 0 and nbytes == 6 * changed


def test_xor_zstd_shrinks_with_the_share_that_changed():
    encode = codecs()["slime_xor_zstd3"][0]
    sizes = []
    for density in (0.0, 0.01, 0.3):
        old, new = _weights_and_update(density)
        sizes.append(encode(bits(old), bits(new))[1])
    full = sum(v.numel() * 2 for v in old.values())
    assert sizes[0] < sizes[1] < sizes[2] and sizes[0] < full / 20


@pytest.mark.integration
def test_bench_sync_reports_the_peer_formats_beside_rollwise(capsys):
    import json

    from rollwise.bench import sync
    assert sync.main(["--models", "tiny", "--tiny-lrs", "1e-5", "--tiny-steps", "1",
                      "--json"]) == 0
    s, = json.loads(capsys.readouterr().out)["summary"]
    assert set(s["peers"]) == set(codecs())
    assert s["bit_exact"] and all(v["exact"] for v in s["peers"].values())
    for v in s["peers"].values():  # ratios are against the same full payload
        assert v["bytes_ratio"] == pytest.approx(s["full_mb"] / v["mb"])
        assert v["rollwise_smaller"] == (s["sparse_mb"] < v["mb"])
    assert s["rollwise_fewest_bytes"] == all(v["rollwise_smaller"] for v in s["peers"].values())


@pytest.mark.integration
def test_bench_sync_codes_the_sparse_payload_as_asked(capsys):
    """--coding context: the same steps' payload, bit-exact, smaller than delta's (at lr 1e-4
    more than half the bf16 values change: delta falls back towards whole tensors there, the
    context coding's per-exponent codes do not)."""
    import json

    from rollwise.bench import sync
    sizes = {}
    for coding in ("delta", "context"):
        assert sync.main(["--models", "tiny", "--tiny-lrs", "1e-4", "--tiny-steps", "1",
                          "--coding", coding, "--json"]) == 0
        s, = json.loads(capsys.readouterr().out)["summary"]
        assert s["coding"] == coding and s["bit_exact"]
        sizes[coding] = (s["density_mean"], s["sparse_mb"])
    assert sizes["context"][0] == sizes["delta"][0]  # the same steps
    assert sizes["context"][1] < sizes["delta"][1] / 2


@pytest.mark.integration
def test_bench_sync_measures_every_coding_after_a_configs_own_steps(capsys):
    """--config: the run's own RL steps move the weights; after each, every coding encodes the
    same change, the sent one arrives bit-exact, and each ratio is full bytes over its own.
    The tiny warm start earns no reward yet, so an entropy bonus on every group is what moves
    the weights here."""
    import json

    from rollwise.bench import sync
    from rollwise.bench.gpu_check import TINY_RUN
    assert sync.main(["--config", "configs/default.yaml", "--lrs", "1e-4", "--steps", "2",
                      "--coding", "context", "--json", *TINY_RUN, "train.entropy_coef=0.01",
                      "filter.drop_equal_reward_groups=false",
                      "train.skip_zero_advantage=false"]) == 0
    out = json.loads(capsys.readouterr().out)
    s, = out["summary"]
    assert s["model"] == "default" and s["steps"] == 2 and s["bit_exact"]
    for row in out["rows"]:
        assert row["density"] > 0 and row["train_s"] > 0
        assert row["coding_bytes"]["context"] == row["sparse_bytes"]
        assert set(row["coding_bytes"]) == set(sync.CODINGS)
        assert all(b > 0 for b in row["coding_bytes"].values())
        assert row["sparse_bytes"] < row["full_bytes"]
    for c in sync.CODINGS:
        assert s["coding_ratio"][c] == pytest.approx(s["full_mb"] / s["coding_mb"][c])
    smallest = {min(sync.CODINGS, key=r["coding_bytes"].get) for r in out["rows"]}
    assert s["smallest_coding"] == (smallest.pop() if len(smallest) == 1 else None)


def test_bench_sync_refuses_overrides_without_a_config():
    from rollwise.bench import sync
    with pytest.raises(SystemExit):
        sync.main(["--models", "tiny", "train.lr=1e-5"])
