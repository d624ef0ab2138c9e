"""bench attention (the decode-attention candidates agree and are timed) and bench graph (the
decode graph's cold and warm start in fresh processes, its log-probabilities against a full
forward pass), on small shapes and the tiny model."""

import json

import pytest

from rollwise import models
from rollwise.bench import attention, graph
from rollwise.config import ModelConfig


# times every attention candidate: integration
@pytest.mark.integration
def test_attention_candidates_agree_and_are_timed(capsys):
    assert attention.main(["--json", "--batch", "4", "--keys", "16,32", "--heads", "4",
                           "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ran = [r for r in out["rows"] if "us" in r]
    assert {r["candidate"] for r in ran} >= {"sdpa_grouped", "sdpa_gqa", "bmm", "compiled"}
    assert all(r["us"] > 0 and r["max_diff"] < 1e-5 for r in ran)


@pytest.mark.integration
def test_graph_start_is_cached_and_its_logprobs_match_a_full_forward(tmp_path, capsys):
    # the engine tests' wild model's shape: the graphs compiled here serve them from the cache
    model, tok = models.build(ModelConfig(arch="qwen2", hidden_size=32, num_layers=2,
                                          num_heads=4, num_kv_heads=2, intermediate_size=64),
                              seed=0)
    models.save(model, tok, tmp_path / "model")
    argv = ["--json", "--model-dir", str(tmp_path / "model"), "--dtype", "float32",
            "--threads", "1", "--prompts", "3", "--new-tokens", "6"]
    assert graph.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first, second = out["startup"]
    assert first["graphs_compiled"] > 0 and first["graphs_from_cache"] == 0
    assert second["graphs_compiled"] == 0  # the second run compiles nothing: it loads
    assert second["graphs_from_cache"] == first["graphs_compiled"]
    for row in out["numerics"]:
        assert row["tokens"] == 18 and row["max_abs"] < 1e-4
