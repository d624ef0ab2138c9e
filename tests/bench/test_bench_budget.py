"""`rollwise bench budget`: every method spends its share of one token budget, and the
summary's ratios are computed from the runs."""

import json

import pytest

from rollwise.bench import budget


def test_summary_ratios_come_from_the_runs():
    def run(method, seed, tokens, final):
        return {"method": method, "seed": seed, "tokens_to_target": tokens,
                "seconds_to_target": tokens / 100, "final_pass1": final, "tokens": 1000}
    runs = [run("grpo", 0, 600, 0.5), run("grpo", 1, 800, 0.6), run("grpo", 2, 700, 0.7),
            run("arrol", 0, 300, 0.6), run("arrol", 1, 400, 0.6), run("arrol", 2, 500, 0.6),
            run("duet50", 0, 900, 0.4), run("duet50", 1, 900, 0.8), run("duet50", 2, 900, 0.7),
            run("sgpo", 0, 140, 0.5), run("sgpo", 1, 280, 0.5), run("sgpo", 2, 350, 0.5)]
    out = budget.summarize(runs, [0, 1, 2])
    assert out["arrol_speedup"] == 700 / 400
    assert abs(out["duet50_pass1_delta"] - (-0.1 + 0.2 + 0.0) / 3) < 1e-12
    assert out["sgpo_compute_ratio"] == 280 / 700


@pytest.mark.parametrize("task", ["stepped", "longtail"])
def test_bench_budget_runs_each_method_within_its_token_share(tmp_path, capsys, task):
    small = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=200",
             "task.eval_size=20", "sft.steps=20", "generate.max_new_tokens=16",
             "control.prompts_per_step=2", "task.filler_tail_mean=8"]
    assert budget.main(["--task", task, "--seeds", "0", "--methods", "grpo", "duet50",
                        "--tokens", "300", "--target", "0.99", "--eval-every", "2",
                        "--root", str(tmp_path), "--json", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["method"]: r for r in out["runs"]}
    assert runs["grpo"]["tokens"] >= 300 and runs["duet50"]["tokens"] >= 150
    # each run stops at the first step past its share: less than one step beyond it
    for r, share in ((runs["grpo"], 300), (runs["duet50"], 150)):
        per_step = r["tokens"] / r["steps"]
        assert r["tokens"] - share < 2 * 2 * 8 * 16 and per_step > 0
        assert r["curve"][-1]["tokens"] == r["tokens"]
    assert "duet50_pass1_delta" in out
    grpo = runs["grpo"]
    assert not grpo["reached"] and grpo["tokens_to_target"] == grpo["tokens"]
    assert out["task"] == task and grpo["target"] == 0.99


def test_bench_budget_target_defaults_to_the_start_plus_the_gain(tmp_path, capsys):
    small = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=200",
             "task.eval_size=20", "sft.steps=20", "generate.max_new_tokens=16",
             "control.prompts_per_step=2"]
    assert budget.main(["--seeds", "0", "--methods", "grpo", "--tokens", "100", "--gain", "0.3",
                        "--root", str(tmp_path), "--json", *small]) == 0
    run, = json.loads(capsys.readouterr().out)["runs"]
    assert run["target"] == pytest.approx(run["start_pass1"] + 0.3)
    assert run["reached"] == any(c["pass1"] >= run["target"] for c in run["curve"])
