"""`rollwise bench gpu` runs its whole code path on a CPU (tiny preset): every row present,
the decode roofline from its closed form, and a clear refusal of cuda where there is none."""

import json

import pytest
import torch

from rollwise.bench import gpu


# runs every part of the GPU bench on the tiny model (about a minute): integration
@pytest.mark.integration
def test_bench_gpu_on_cpu_reports_every_part(capsys):
    argv = ["--json", "--device", "cpu", "--preset", "tiny", "--seqs", "2,4", "--new-tokens",
            "4", "--prompt-len", "6", "--response-len", "8", "--train-groups", "2",
            "--repeats", "1", "--microbatch-tokens", "64"]
    assert gpu.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gen = [r for r in out["rows"] if r["part"] == "generate" and "skipped" not in r]
    assert {(r["backend"], r["sequences"], r["profile"]) for r in gen} >= {
        (b, n, "equal") for b in ("graph", "builtin", "hf") for n in (2, 4)} | {
        ("graph", 4, "longtail"), ("builtin", 4, "longtail")}
    assert all(r["tokens_per_s"] > 0 and 0 < r["of_roofline"] < 1 for r in gen)
    for r in out["rows"]:  # peers this machine lacks say why
        assert "skipped" not in r or r["skipped"]
    train = [r for r in out["rows"] if r["part"] == "train"]
    assert [(r["chunked_logits"], r["fused_adamw"], r["gradient_checkpointing"])
            for r in train] == [(False, False, False), (True, False, False), (True, True, False),
                                (True, True, True)]  # each lever added to the row before
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train)
    assert out["measured_bandwidth"] > 0 and out["measured_flops"] > 0


def test_decode_roofline_is_bandwidth_over_bytes_read_per_step():
    model = gpu.build("tiny", "cpu")
    c = model.config
    weights = sum(p.numel() for p in model.parameters()) * 2  # bf16
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size //
                                                            c.num_attention_heads) * 2
    got = gpu.decode_roofline(model, {"bandwidth": 1e12}, 64, 100, 50)
    assert got == pytest.approx(64 * 1e12 / (weights + 64 * kv * 125))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_bench_gpu_without_a_gpu_says_how_to_run_it(capsys):
    assert gpu.main(["--json"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
