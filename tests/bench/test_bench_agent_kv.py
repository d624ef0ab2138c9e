"""`rollwise bench agent_kv` end to end on its long scenario, small: the same episodes with the
prefix cache and without (the bench raises otherwise), the cache's prefills plus its reuse equal
the plain engine's prefills, and the keys are those figures."""

import json

from rollwise.bench import agent_kv


def test_bench_agent_kv_reports_its_keys(tmp_path, capsys):
    assert agent_kv.main(["--scenario", "long", "--problems", "2", "--repeats", "1", "--json",
                          "--root", str(tmp_path), "model.hidden_size=32",
                          "model.intermediate_size=64"]) == 0
    out = json.loads(capsys.readouterr().out)
    off, on = out["per_round"]["off"], out["per_round"]["on"]
    assert off["turns"] == on["turns"] > 2 * 8  # episodes went on past their first turn
    assert off["reused_tokens"] == 0 < on["reused_tokens"]
    assert on["prefill_tokens"] + on["reused_tokens"] == off["prefill_tokens"]
    assert on["reprefilled"] == 0 < off["reprefilled"]
    assert out["kv_prefill_saved"] == 1 - on["prefill_tokens"] / off["prefill_tokens"]
    med = out["median_seconds"]
    assert out["kv_round_speedup"] == med["off"] / med["on"]
