"""Shared helpers of the tests (not a test module)."""

from __future__ import annotations

import json
import os
import sys
import traceback

from rollwise.bench.crash import metric_rows
from rollwise.cli import main
from rollwise.loop.run import Run
from rollwise.store.killpoint import ENV
from rollwise.store.rollouts import RolloutStore
from rollwise.types import Problem

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
         "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=6",
         "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
         "run.log=quiet", "run.threads=1", "filter.workers=0", "run.report=false",
         "run.tensorboard=false", "run.checkpoint_every=2", "run.keep_checkpoints=2",
         "filter.reward=tests.loop_helpers:parity"]

def fork_main(argv: list[str], kill_at: str | None = None, before_step=None) -> int:
    """rollwise's CLI in a forked child; returns its exit code (-9 when SIGKILLed)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.environ.pop(ENV, None)
            if kill_at:
                os.environ[ENV] = kill_at
            if before_step is not None:  # before each step's generation, in either loop
                produce = Run.produce
                Run.produce = lambda self, n: (before_step(n), produce(self, n))[1]
            code = main(argv)
        except BaseException:  # as the interpreter would: the traceback on stderr
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


# 2 minibatches; micro-batches of 5 rows: 3 per minibatch of 12, so one rank pads
SHARDED = ["train.minibatches=2", "train.micro_batch_size=5"]


def rows(run_dir):
    return RolloutStore(run_dir / "rollouts").read().to_pylist()

def check_resumed(run, steps: int, eta: int) -> None:
    """A resumed run wrote each step once, stored each rollout once, none lost, every trained
    token within eta versions."""
    metrics = metric_rows(run)
    assert [m["step"] for m in metrics] == list(range(steps + 1))  # each step written once
    assert max(m["staleness/max"] for m in metrics[1:]) <= eta
    stored = rows(run)
    assert len({r["uid"] for r in stored}) == len(stored)
    per_step = {}
    for r in stored:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    assert sorted(per_step) == list(range(1, steps + 1))
    assert len(set(per_step.values())) == 1  # every step's rollouts, none lost
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts"] == len(stored)
    assert summary["steps"] == steps


def _check_store(run, cfg, steps):
    rows = run.store.read().to_pylist()
    uids = [r["uid"] for r in rows]
    assert len(uids) == len(set(uids))  # none stored twice
    per_step = {s: sum(r["step"] == s for r in rows) for s in range(1, steps + 1)}
    want = cfg.control.prompts_per_step * cfg.generate.group_size
    assert per_step == {s: want for s in per_step}  # none lost
    for r in rows:
        n = len(r["response_ids"])
        assert 0 < n <= cfg.generate.max_new_tokens
        assert len(r["logprobs"]) == len(r["versions"]) == n
        assert r["status"] in ("completed", "truncated")


PROBLEMS = [Problem(f"p{i}", f"{i}+{i % 7}=", str(i + i % 7), tier="ab"[i % 2])
            for i in range(200)]

class Loop:
    """Control's part of a round: the in-flight controller and a prompt stream."""

    def __init__(self, inflight):
        self.inflight = inflight
        self.stream = iter(PROBLEMS)

    def select(self, n, step, ledger):
        return [next(self.stream) for _ in range(n)]

    def sized(self, problems, step, ledger):
        return problems  # every prompt its generator's group size


def parity(response, problem):
    """Mixed rewards even from an untrained model, so every step trains."""
    return float(len(response) % 2), "parity"


def first_column(response, problem):
    """A stepped scratchpad rewarded for its first column alone: a response SCOPE rectified
    at that column scores higher than the one it rectified."""
    from rollwise.stages.filter.process import reference_steps
    return float(response.startswith(reference_steps(problem)[0])), "first column"


SHORT_RUN = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
             "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=3",
             "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
             "run.log=quiet"]


def flaky_reward(response, problem):
    if problem.answer.endswith("7"):
        raise RuntimeError("reward server down")
    return float(len(response) % 2), "parity"


def coin_reward(response, problem):
    """Deterministic 0/1 from the text, so groups are often mixed even for a random model."""
    return float(sum(map(ord, response + problem.id)) % 2), "coin"



class UncountedEngine:
    """A plugin engine that does not subclass Engine and counts no prefill: the built-in
    engine behind every other name."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        if name == "prefill_tokens":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):  # the loop's writes (a failed sync's version) go in
        if name == "prefill_tokens":
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)


def uncounted_engine(cfg, model, tokenizer=None, run_dir=None):
    from rollwise.engine.backends import builtin
    return UncountedEngine(builtin(cfg, model, tokenizer, run_dir))


class NoKeepEngine(UncountedEngine):
    """A plugin engine that cannot keep a paused sequence's K/V (no can_keep_paused)."""

    def __getattr__(self, name):
        if name == "can_keep_paused":
            raise AttributeError(name)
        return super().__getattr__(name)


def no_keep_engine(cfg, model, tokenizer=None, run_dir=None):
    from rollwise.engine.backends import builtin
    return NoKeepEngine(builtin(cfg, model, tokenizer, run_dir))
