"""End to end on a very small setup: the run directory, the store, eval reproduction, and a
reward function that fails on some samples without stopping the run."""

import json

import pyarrow.parquet as pq
import pytest
from loop_helpers import SHORT_RUN

from rollwise.cli import main
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.store.rollouts import RolloutStore
from rollwise.types import Status

pytestmark = pytest.mark.integration  # whole training loops


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, SHORT_RUN + [f"run.root={root}", "run.name=t",
                                     "filter.reward=tests.loop_helpers:flaky_reward"])
    return cfg, train(cfg)


def test_run_directory_has_everything(run):
    cfg, summary = run
    d = cfg.run.root + "/t"
    for key in ("eval_pass1_start", "eval_pass1_end", "steps", "rollouts", "tokens_generated",
                "wall_seconds"):
        assert key in summary
    on_disk = json.load(open(f"{d}/summary.json"))
    assert on_disk["rollouts"] == summary["rollouts"] == 3 * 6 * 4
    lines = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert "eval/pass1" in lines[2] and "eval/pass1" in lines[3] and "eval/pass1" not in lines[1]
    assert sum(m.get("tokens/generated", 0) for m in lines) == summary["tokens_generated"]
    load_config(f"{d}/config.yaml")  # the saved config loads back
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (cfg.run.root and __import__("pathlib").Path(d, "model", f).exists())


def test_store_holds_every_rollout_once_with_token_columns(run):
    cfg, summary = run
    samples = RolloutStore(cfg.run.root + "/t/rollouts").samples()
    assert len(samples) == summary["rollouts"]
    assert len({s.uid for s in samples}) == len(samples)
    for s in samples:
        s.check()
        assert s.versions == [s.step - 1] * len(s.response_ids)  # on-policy: version = step - 1
    table = pq.read_table(cfg.run.root + "/t/rollouts/step-000001.parquet")
    assert table.num_rows == 24


def test_failing_reward_marks_samples_failed_and_run_goes_on(run):
    cfg, summary = run
    samples = RolloutStore(cfg.run.root + "/t/rollouts").samples()
    failed = [s for s in samples if s.status == Status.FAILED]
    assert failed and all(s.meta["answer"].endswith("7") for s in failed)
    assert all("reward server down" in s.reward_info and s.reward == 0 for s in failed)
    lines = [json.loads(x) for x in open(cfg.run.root + "/t/metrics.jsonl")][1:]
    assert sum(m.get("filter/failed", 0) for m in lines) == len(failed)
    assert sum(m.get("filter/failed/error", 0) for m in lines) == len(failed)
    # stored with their reason, never trained (the trainer refuses one: the run finished)
    assert summary["steps"] == cfg.train.steps
    assert sum(m.get("decisions/filter/unscored/verifier_failed", 0) for m in lines) == \
        len(failed)
    assert sum(m.get("tokens/unscored", 0) for m in lines) == sum(s.num_tokens for s in failed)
    assert sum(m.get("decisions/filter/drop/too_few_scored", 0) for m in lines) == \
        len({s.group_id for s in failed})  # every sample of such a group failed


def test_eval_command_reproduces_the_end_figure(run, capsys):
    cfg, summary = run
    assert main(["eval", "--model", f"{cfg.run.root}/t/model", "run.log=quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/pass1"] == summary["eval_pass1_end"]


def test_eval_searches_by_direction_or_by_candidate_on_the_same_first_draws(run, capsys):
    cfg, _ = run
    overrides = ["run.eval_samples=6", "run.eval_temperature=1.0", "run.search.directions=3",
                 "run.search.prefix_tokens=2"]
    got = {}
    for by in ("dora", "solution"):
        assert main(["eval", "--model", f"{cfg.run.root}/t/model", "--search", by,
                     *overrides]) == 0
        got[by] = json.loads(capsys.readouterr().out)
    for out in got.values():
        assert 0 <= out["eval/search_acc"] <= 1 and 1 <= out["eval/search_directions"] <= 3
    # the first candidates are the same draws: the directions found do not depend on the rule
    assert got["dora"]["eval/search_directions"] == got["solution"]["eval/search_directions"]
    with pytest.raises(SystemExit):  # one way of playing the draws at a time
        main(["eval", "--model", f"{cfg.run.root}/t/model", "--vote", "majority", "--search",
              "dora"])
