"""`rollwise bench april`: APRIL against synchronous groups, here through --config."""

import json

import pytest

from rollwise.bench import april
from rollwise.bench.gpu_check import TINY_RUN


@pytest.mark.integration
def test_bench_april_runs_a_configs_own_model_in_both_modes(tmp_path, capsys):
    root = tmp_path / "april"
    assert april.main(["--config", "configs/default.yaml", "--steps", "2", "--repeats", "1",
                       "--root", str(root), "--json", *TINY_RUN, "train.steps=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    none, = out["runs"]["none"]
    ap, = out["runs"]["april"]
    for run in (none, ap):  # every decoded token is trained or still carried (else it raises)
        assert run["decoded_tokens"] == run["batch_tokens"] + run["carried_tokens_end"]
        assert run["throughput"] == pytest.approx(run["batch_tokens"] / run["gen_seconds"])
    assert none["carried_tokens_end"] == 0 and none["stale_tokens"] == 0
    assert out["speedups"] == [pytest.approx(ap["throughput"] / none["throughput"])]
    assert not (root / "warm-start").exists()  # the config's own model, no built-in warm start


def test_bench_april_refuses_a_bad_override_before_any_run(tmp_path):
    with pytest.raises(Exception, match="no_such_key"):
        april.main(["--config", "configs/default.yaml", "--root", str(tmp_path),
                    "run.no_such_key=1"])
