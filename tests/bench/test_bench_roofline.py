"""The roofline's bounds against their closed forms, and `bench engine` at RL shapes: the same
tokens for every backend, the task's own prompts, each figure beside its bound."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollwise.bench import engine, roofline


def tiny_llama(dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_bound_is_the_slower_of_compute_and_memory(dtype):
    model = tiny_llama(dtype)
    # by hand: q, o 64x64; k, v 64x32 (2 kv heads of 16); gate, up, down 64x96; head 300x64
    linear = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96) + 300 * 64
    size = 4 if dtype == torch.float32 else 2
    weights = (300 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 64) * size
    kv_token = 2 * 2 * 2 * 16 * size  # K and V, layers, kv heads, head dim
    batch, ctx = 8, 50.0
    flops = 2 * linear + 4 * 2 * 4 * 16 * ctx
    for peaks in ({"flops": {"float32": 1e9, "bfloat16": 4e9}, "bandwidth": 1e12},
                  {"flops": {"float32": 1e15, "bfloat16": 1e15}, "bandwidth": 1e6}):
        rate = peaks["flops"]["float32" if dtype == torch.float32 else "bfloat16"]
        step = max(batch * flops / rate, (weights + batch * kv_token * ctx) / peaks["bandwidth"])
        assert roofline.decode_bound(model, peaks, batch, ctx) == pytest.approx(batch / step)
    assert roofline.train_flops_per_token(model, ctx) == pytest.approx(
        6 * linear + 6 * 2 * 4 * 16 * ctx)


def test_measured_peaks_are_positive_and_named():
    assert roofline.matmul_rate(torch.float32, n=64) > 0
    assert roofline.matmul_rate(torch.bfloat16, n=64) > 0
    assert roofline.bandwidth(n_bytes=1 << 20) > 0
    assert roofline.main(["--json"]) == 0


def test_rl_shapes_lengths_and_prompts():
    assert engine.lengths_for("equal", 512, "rl") == [128] * 512
    tail = engine.lengths_for("longtail", 512, "rl")
    assert 1 <= min(tail) and max(tail) == 256 and 0.05 < tail.count(256) / 512 < 0.2
    assert sorted(tail)[256] < 128  # most responses are short: the tail is long
    ids = engine.prompts_for("equal", 512, 49152, "rl")
    assert all(ids[i] == ids[i - i % 8] for i in range(512))  # groups of 8 share a prompt
    assert len({tuple(p) for p in ids}) == 64
    assert max(max(p) for p in ids) > 1000  # drawn from the whole vocabulary, not its first ids
    given = [[5, 6, i] for i in range(64)]
    assert engine.prompts_for("longtail", 512, 100, "rl", task_prompts=given)[17] == [5, 6, 2]


def test_prompts_of_a_config_are_its_task_rendered(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: {name: arith}\n")
    from rollwise import models
    from rollwise.config import ModelConfig
    _, tok = models.build(ModelConfig(), seed=0)
    prompts = engine.task_prompts(str(cfg), tok, 4)
    from rollwise.config import load_config
    from rollwise.tasks import load_task
    task = load_task(load_config(str(cfg)).task)
    assert [tok.decode(p) for p in prompts] == [p.prompt for p in task.train[:4]]


# the engine bench at RL shape, every backend (about a minute): integration
@pytest.mark.integration
def test_bench_engine_rl_shape_same_tokens_and_bounds(capsys):
    argv = ["--json", "--shape", "rl", "--backends", "builtin,hf", "--repeats", "1",
            "--threads", "1"]
    assert engine.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["scenario"], r["slots"], r["backend"]): r for r in out["rows"]}
    shapes = [(s, slots) for s in ("equal", "longtail") for slots in (64, 512)]
    assert set(rows) == {(s, n, b) for s, n in shapes for b in ("builtin", "hf")}
    for s, n in shapes:
        want = sum(engine.lengths_for(s, 512, "rl"))
        assert rows[s, n, "builtin"]["tokens"] == rows[s, n, "hf"]["tokens"] == want
        assert all(0 < rows[s, n, b]["of_bound"] < 1 for b in ("builtin", "hf"))
    assert out["roofline"]["flops"]["bfloat16"] > 0
