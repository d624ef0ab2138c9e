"""`rollwise bench trees`: both parts' arms spend one token budget, trees branch and count what
they saved, and the summary's ratios come from the runs."""

import json
import os
import signal

import pytest

from rollwise.bench import trees
from rollwise.bench.jobs import execute
from rollwise.devices import machine
from rollwise.types import Group, Sample


def test_summary_ratios_come_from_the_runs():
    def run(part, arm, seed, tokens, mixed, final, acc=None):
        return {"part": part, "arm": arm, "seed": seed, "tokens_to_target": tokens,
                "steps_to_target": tokens / 10, "final_pass1": final, "mixed_share": mixed,
                "distinct_answers": 2.0, "forks": 0, "pruned": 0, "prefix_saved": 0,
                "seconds": 1.0, "reached": True, "label_acc": acc}
    runs = [run("latr", "iid", 0, 600, 0.2, 0.5), run("latr", "iid", 1, 800, 0.3, 0.5),
            run("latr", "iid", 2, 700, 0.4, 0.5), run("latr", "latr", 0, 300, 0.3, 0.5),
            run("latr", "latr", 1, 500, 0.6, 0.5), run("latr", "latr", 2, 400, 0.3, 0.5),
            run("echo", "iid", 0, 9, 0.1, 0.30, 0.5), run("echo", "iid", 1, 9, 0.1, 0.40, 0.6),
            run("echo", "echo", 0, 9, 0.1, 0.35, 0.7), run("echo", "echo", 1, 9, 0.1, 0.30, 0.6)]
    out = trees.summarize(runs, [0, 1, 2])
    assert out["latr_tokens_to_target_ratio"] == 400 / 700
    assert abs(out["latr_mixed_share_ratio"] - 0.4 / 0.3) < 1e-12
    assert abs(out["echo_ttrl_pass1_delta"] - (0.05 - 0.10) / 2) < 1e-12
    assert abs(out["echo_label_acc_delta"] - (0.2 + 0.0) / 2) < 1e-12


def test_distinct_answers_reads_the_task_extractor():
    class FakeRun:
        class task:
            @staticmethod
            def extract_answer(text):
                return text.rsplit(":", 1)[1] if ":" in text else None

        @staticmethod
        def decode(ids):
            return "".join(chr(i) for i in ids)
    enc = lambda t: [ord(c) for c in t]  # noqa: E731
    g1 = Group("a", [Sample("a", [1], enc(t)) for t in ("1+2=3;:3", "x:3", "y:4", "no")])
    g2 = Group("b", [Sample("b", [1], enc(t)) for t in ("a:1", "b:1")])
    assert trees.distinct_answers(FakeRun, [g1, g2]) == (3 + 1) / 2


def test_bench_trees_runs_every_arm_within_one_budget_and_trees_branch(tmp_path, capsys):
    small = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=200",
             "task.eval_size=20", "sft.steps=20", "generate.max_new_tokens=24",
             "control.prompts_per_step=2", "generate.group_size=4",
             # branch wherever the second token has any mass, so the tree surely forks
             "generate.latr.tau_abs=0.0", "generate.latr.tau_rel=1.0", "generate.latr.ages=[2]",
             "generate.echo.entropy_threshold=1.01", "generate.echo.min_position=2",
             "generate.echo.conf_threshold=100",
             "generate.echo.delta_threshold=-100", "generate.echo.prune=false"]
    assert trees.main(["--seeds", "0", "--tokens", "400", "--ttrl-tokens", "300",
                       "--eval-every", "2", "--gain", "0.99", "--root", str(tmp_path),
                       "--json", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {(r["part"], r["arm"]): r for r in out["runs"]}
    assert set(runs) == {("latr", "iid"), ("latr", "latr"), ("echo", "iid"), ("echo", "echo")}
    per_step_max = 2 * 4 * 24
    for (part, _), r in runs.items():
        budget = 400 if part == "latr" else 300
        assert budget <= r["tokens"] < budget + per_step_max  # stops at the first step past it
        assert r["curve"][-1]["tokens"] == r["tokens"]
        assert not r["reached"] and r["tokens_to_target"] == r["tokens"]
    assert runs[("latr", "latr")]["forks"] > 0 and runs[("latr", "latr")]["prefix_saved"] > 0
    assert runs[("echo", "echo")]["forks"] > 0
    assert runs[("latr", "iid")]["forks"] == 0
    for arm in ("iid", "echo"):  # the tiny warm start's votes may leave no group labelled
        acc = runs[("echo", arm)]["label_acc"]
        assert acc is None or 0 <= acc <= 1
    for k in ("latr_tokens_to_target_ratio", "latr_mixed_share_ratio", "echo_ttrl_pass1_delta"):
        assert isinstance(out[k], float)



def _maybe_fail(part, arm, seed):
    if arm == "bad":
        raise RuntimeError("engine fell over")
    if arm == "killed":  # as the kernel's out-of-memory killer does
        os.kill(os.getpid(), signal.SIGKILL)
    return {"part": part, "arm": arm, "seed": seed, "pid": os.getpid()}


@pytest.mark.parametrize("n_jobs", [1, pytest.param(2, marks=pytest.mark.integration)])
def test_a_failing_run_is_reported_and_loses_no_other_run(tmp_path, n_jobs):
    jobs = [("latr", arm, 0) for arm in ("iid", "bad", "latr")]
    runs, failed = execute(_maybe_fail, jobs, n_jobs, tmp_path / "runs.jsonl",
                           lambda j: {"part": j[0], "arm": j[1], "seed": j[2]})
    assert sorted(r["arm"] for r in runs) == ["iid", "latr"]
    assert len(failed) == 1 and failed[0]["arm"] == "bad"
    assert "engine fell over" in failed[0]["error"]
    logged = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in logged) == ["bad", "iid", "latr"]
    assert {r["machine"] for r in logged} == {machine()}  # seconds compare on one machine


@pytest.mark.integration
def test_runs_side_by_side_each_get_a_fresh_process_and_a_killed_one_fails_alone(tmp_path):
    jobs = [("latr", arm, seed) for arm in ("iid", "killed", "latr") for seed in (0, 1)]
    runs, failed = execute(_maybe_fail, jobs, 2, tmp_path / "runs.jsonl",
                           lambda j: {"part": j[0], "arm": j[1], "seed": j[2]})
    assert sorted((r["arm"], r["seed"]) for r in runs) == [("iid", 0), ("iid", 1),
                                                           ("latr", 0), ("latr", 1)]
    assert len({r["pid"] for r in runs} | {os.getpid()}) == 5  # no process runs twice
    assert sorted((r["arm"], r["seed"]) for r in failed) == [("killed", 0), ("killed", 1)]
    assert all("process died" in r["error"] and "fewer --jobs" in r["error"] for r in failed)
    logged = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(logged) == 6
