"""A run started by rollwise.train() with Python objects stops and resumes as a CLI run does:
the stop says to resume in Python (not with a command that cannot work), writes the report, the
CLI refuses the run before any work naming the objects, and rollwise.train(..., resume=True)
with the same objects ends equal to an uninterrupted run."""

import os
import signal
import sys
import traceback

import pytest

import rollwise
from rollwise.bench.crash import compare
from rollwise.cli import main
from rollwise.loop.run import Run

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1], "solution": str(a + b)[::-1]}
        for a in range(10, 40) for b in range(10, 30)]
SMALL = {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                   "intermediate_size": 64},
         "sft": {"steps": 20}, "train": {"steps": 5},
         "control": {"prompts_per_step": 6}, "generate": {"group_size": 4},
         "task": {"eval_size": 16}, "filter": {"workers": 0},
         "run": {"eval_every": 2, "log": "plain", "threads": 1, "tensorboard": False,
                 "checkpoint_every": 2}}


def reward(response: str, problem) -> float:
    return float(response.strip() == problem.answer)


def _train(root, name, resume=False):
    run = {**SMALL["run"], "root": str(root), "name": name}
    return rollwise.train({**SMALL, "run": run}, dataset=ROWS, reward=reward, resume=resume)


def _in_child(fn, out_path) -> int:
    """fn() in a forked child, its stdout to out_path; the child's exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sys.stdout = sys.stderr = open(out_path, "w", buffering=1)  # pytest's are not fds
            summary = fn()
            code = 3 if "stopped_at" in summary else 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.integration
def test_a_python_run_stops_says_how_to_resume_and_resumes_exactly(tmp_path, capsys):
    assert _in_child(lambda: _train(tmp_path, "whole"), tmp_path / "whole.log") == 0

    def stopped():
        produce = Run.produce

        def signal_at_step_3(self, n):
            if n == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 3 runs
            return produce(self, n)
        Run.produce = signal_at_step_3
        return _train(tmp_path, "stopped")
    assert _in_child(stopped, tmp_path / "stopped.log") == 3
    said = (tmp_path / "stopped.log").read_text()
    assert "continue with rollwise.train(..., resume=True) given the same dataset, reward" in said
    assert "rollwise train --resume" not in said
    run = tmp_path / "stopped"
    assert (run / "report.html").is_file()  # every stop writes the report
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "started by rollwise.train() with Python objects" in err
    assert "dataset (600 rows)" in err and "reward (reward)" in err
    resumed = lambda: _train(tmp_path, "stopped", resume=True)  # noqa: E731
    assert _in_child(resumed, tmp_path / "resumed.log") == 0
    assert compare(tmp_path / "whole", run) == []
