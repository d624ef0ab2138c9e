"""rollwise bench async: the measurements (evaluation time excluded), the cost model against its
closed form, and a tiny end-to-end run with its JSON keys and report section."""

import json

import pytest
import torch
from loop_helpers import SMALL

from rollwise.bench import async_ as bench


def test_measure_excludes_evaluation_time():
    rows = [{"step": 0, "wall_seconds": 5.0, "perf/eval_seconds": 2.0, "eval/pass1": 0.1},
            *({"step": s, "wall_seconds": 5.0 + 3 * s + (2.0 if s >= 2 else 0.0),
               "train/tokens": 100.0, "perf/gen_seconds": 1.0, "perf/train_seconds": 2.0,
               "sync/full_bytes": 1000.0, "sync/bytes": 10.0, "sync/seconds": 0.01,
               "sync/sparse": 1.0, **({"perf/eval_seconds": 2.0, "eval/pass1": 0.9}
                                      if s == 2 else {})} for s in (1, 2, 3))]
    m = bench.measure(rows, target=0.8)
    # 3 steps of 3 s each once both evaluations (2 s each) are taken out
    assert m["seconds"] == pytest.approx(9.0)
    assert m["tokens_per_s"] == pytest.approx(300 / 9.0)
    assert m["seconds_to_target"] == pytest.approx(6.0) and m["reached"]


def test_cost_model_matches_its_closed_form():
    assert bench._per_byte([(10, 1.0), (20, 2.0), (40, 4.0)]) == pytest.approx(0.1)
    model = {"gen_s": 4.0, "train_s": 1.0, "sync_s_per_byte": 1.5e-3, "full_bytes": 1000,
             "sparse_bytes": 100, "worker_overhead_s": 0.25, "tokens_per_step": 600}
    curves = bench.simulate(model, [1, 2, 8])
    assert curves["sync/full"][0] == pytest.approx(600 / (4 + 1 + 1.5))
    assert curves["async/full"][0] == pytest.approx(600 / 4)
    assert curves["sync/sparse"][1] == pytest.approx(600 / (2.25 + 1 + 0.15))
    # many workers: asynchronous training runs at the trainer's own rate
    assert curves["async/sparse"][2] == pytest.approx(600 / 1.15)
    for name, ys in curves.items():
        assert ys == sorted(ys), name
    assert all(a >= s for a, s in zip(curves["async/full"], curves["sync/full"]))


def test_a_runs_threads_do_not_leak_into_the_next_arm(tmp_path):
    # the async arms set run.threads=1; the sync arm after them (run.threads=0) must get the
    # process's own threads back, not run on one
    from rollwise.config import load_config
    from rollwise.loop.run import train
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(load_config(None, SMALL + [f"run.root={tmp_path}", "train.steps=1",
                                         "run.threads=1"]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
def test_tiny_end_to_end(tmp_path, capsys):
    small = [o for o in SMALL if not o.startswith(("train.steps", "run.", "filter.reward"))]
    argv = ["--seeds", "0", "--steps", "4", "--eval-every", "2", "--target", "0",
            "--arms", "sync", "async1", "--root", str(tmp_path), "--json", *small,
            "filter.reward=tests.loop_helpers:parity"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert {"async_speedup", "async_pass1_delta", "cost_model", "arms"} <= set(data)
    assert data["arms"]["async1"]["staleness_max"] <= 1
    assert len(data["cost_model"]["tokens_per_s"]["async/sparse"]) == len(bench.WORKERS)
    assert "Cost model" in (tmp_path / "async_report.html").read_text()


def test_summary_pairs_seeds_and_reports_the_sync_seed_noise():
    def result(arm, seed, pass1, tps):
        return {"arm": arm, "seed": seed, "pass1_end": pass1, "tokens_per_s": tps,
                "seconds_to_target": None, "reached": False, "seconds": 10.0,
                "staleness_max": 0 if arm == "sync" else 1}
    results = [result("sync", 0, 0.8, 100.0), result("sync", 1, 0.6, 120.0),
               result("sync", 2, 0.7, 110.0), result("async1", 0, 0.7, 150.0),
               result("async1", 1, 0.7, 160.0), result("async1", 3, 0.1, 170.0)]
    out = bench.summarize(results)
    assert out["async_speedup"] == pytest.approx(160.0 / 110.0)  # medians
    # seeds 0 and 1 are in both arms: (0.7 - 0.8 + 0.7 - 0.6) / 2; seed 3 has no partner
    assert out["async_pass1_delta"] == pytest.approx(0.0)
    assert out["sync_pass1_sd"] == pytest.approx(0.1)  # the sample sd of 0.8, 0.6, 0.7
    assert out["arms"]["async1"]["staleness_max"] == 1


def test_the_ceiling_is_syncs_step_over_the_slower_side_alone():
    def phases(arm, seed, gen, train):
        return {"arm": arm, "seed": seed, "gen_s": gen, "train_s": train, "pass1_end": 0.5,
                "tokens_per_s": 1.0, "seconds_to_target": None, "reached": False,
                "seconds": 1.0, "staleness_max": 0}
    results = [phases("sync", 0, 0.08, 0.12), phases("sync", 1, 0.10, 0.12),
               phases("sync", 2, 0.09, 0.30),
               phases("alone1", 0, 0.15, 0.25), phases("alone1", 1, 0.30, 0.20),
               phases("alone1", 2, 0.16, 0.22)]
    out = bench.summarize(results)
    # sync's median step is 0.22 s (0.20, 0.22, 0.39); alone, generation's median is 0.16 s
    # and training's 0.22 s: the overlap runs at the slower side's pace at best
    assert out["async_ceiling"] == pytest.approx(0.22 / 0.22)
    assert "async_speedup" not in out  # no async1 arm ran
    results[5]["train_s"] = 0.11  # training's median alone becomes 0.20 s
    assert bench.summarize(results)["async_ceiling"] == pytest.approx(0.22 / 0.20)
