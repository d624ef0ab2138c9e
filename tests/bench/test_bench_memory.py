"""`rollwise bench memory`: a config's run in a fresh process, each phase's peak from its
metrics, the whole process's from the kernel's accounting of the child."""

import json
import sys

import pytest

from rollwise.bench import memory
from rollwise.bench.gpu_check import TINY_RUN

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.integration  # a tiny run in a child process: about 20 s
def test_every_phase_has_a_peak_and_the_kernel_agrees(tmp_path, capsys):
    out = tmp_path / "memory.json"
    tiny = [o for o in TINY_RUN if not o.startswith(("train.steps=", "run.eval_every="))]
    assert memory.main(["--steps", "1", "--root", str(tmp_path), "--json", str(out),
                        *tiny]) == 0
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert {"load", "warm_start", "eval", "generate", "score", "train", "sync"} <= set(phases)
    assert phases["generate"]["step"] == 1 and phases["load"]["step"] == 0
    peak = max(p["peak_gib"] for p in phases.values())
    # the metrics' last figure is the kernel's high-water mark before the final save, the
    # summary's after it; with checkpoints streamed to disk the save adds little
    assert peak <= result["peak_gib"] <= result["kernel_peak_gib"] + 1e-9
    assert result["kernel_peak_gib"] - result["peak_gib"] < 0.25
    rows = [json.loads(x) for x in open(tmp_path / "default-memory" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and "eval/pass1" in rows[1]
    printed = capsys.readouterr().out
    assert "whole process" in printed and "warm_start" in printed


def test_bad_arguments_are_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        memory.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        memory.main(["not-an-override"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_a_failed_run_says_so_with_its_log(tmp_path, capsys):
    assert memory.main(["--root", str(tmp_path), "no.such_key=1"]) == 1
    assert "the run failed" in capsys.readouterr().err


@pytest.mark.parametrize("override, option", [("run.root=elsewhere", "--root"),
                                              ("run.name=mine", "--name"),
                                              ("train.steps=9", "--steps")])
def test_an_override_of_what_the_command_sets_itself_is_refused_naming_its_option(
        override, option, capsys):
    with pytest.raises(SystemExit):
        memory.main([override])
    err = capsys.readouterr().err
    assert override in err and option in err
