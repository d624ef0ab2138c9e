"""Bench runs side by side: each in its own process (one torch thread each), each result
appended to a JSONL log as it finishes, and a failing run reported with its traceback
instead of losing the others."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

from rollwise import models
from rollwise.config import load_config
from rollwise.devices import machine
from rollwise.loop.metrics import step_metrics
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
from rollwise.tasks import load_task
from rollwise.training.sft import warm_start, warm_start_path


def _guarded(fn: Callable[..., dict], job: tuple, label: dict) -> dict:
    try:
        return fn(*job)
    except Exception:
        err = traceback.format_exc()
        print(f"{label} FAILED:\n{err}", file=sys.stderr, flush=True)
        return {**label, "error": err}


def _in_own_process(fn: Callable[..., dict], job: tuple, label: dict) -> dict:
    """fn(*job) in a fresh process: nothing one run leaves in memory reaches the next, and a
    process killed from outside (the kernel's out-of-memory killer) fails its run alone."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as one:
        try:
            return one.submit(_guarded, fn, job, label).result()
        except BrokenProcessPool:
            err = ("the run's process died without a Python error (killed: most often the "
                   "machine ran out of memory; `dmesg` names an OOM kill). Rerun with fewer "
                   "--jobs side by side: the finished runs are kept.")
            print(f"{label} FAILED: {err}", file=sys.stderr, flush=True)
            return {**label, "error": err}


def execute(fn: Callable[..., dict], jobs: list[tuple], n_jobs: int, log: Path,
            label: Callable[[tuple], dict], append: bool = False
            ) -> tuple[list[dict], list[dict]]:
    """fn(*job) for every job (fn a module-level function, for the worker processes), n_jobs
    side by side, each in its own process. label(job) names a job in its failure record.
    Returns (finished results, failure records), in the order they finished, each with the
    machine it ran on. The log starts empty unless `append`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if not append or not log.exists():
        log.write_text("")
    results = []

    def keep(r: dict) -> None:
        r.setdefault("machine", machine())
        results.append(r)
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
    if n_jobs > 1:
        with ThreadPoolExecutor(n_jobs) as pool:
            for f in as_completed([pool.submit(_in_own_process, fn, j, label(j))
                                   for j in jobs]):
                keep(f.result())
    else:
        for j in jobs:
            keep(_guarded(fn, j, label(j)))
    return [r for r in results if "error" not in r], [r for r in results if "error" in r]


def warm_start_folder(config: str | None, overrides: list[str], root: str) -> str:
    """The SFT warm start of this config (cached by its config under root/.cache), saved as a
    model folder that runs load with run.init."""
    cfg = load_config(config, overrides + [f"run.root={root}"])
    task = load_task(cfg.task)
    model, tok = warm_start(cfg, task,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    if cfg.sft.from_path:  # saved as a model folder already, in float32
        return str(warm_start_path(cfg, task))
    path = f"{warm_start_path(cfg, task)}-model"
    models.save(model, tok, path)
    return path


def print_keys_and_failures(out: dict, keys: tuple[str, ...], failed: list[dict],
                            name: Callable[[dict], str]) -> int:
    """The table's footer: each headline key the summary has, then each failed run (name(r)
    and its seed); the bench's exit code (1 if any run failed)."""
    for k in keys:
        if out.get(k) is not None:
            print(f"{k}: {out[k]:.3f}")
    for r in failed:
        print(f"FAILED: {name(r)} seed {r['seed']} (traceback above)")
    return 1 if failed else 0


# every bench run: a constant learning rate (runs of different step counts must not get
# different schedules), quiet, no report, evaluation only where the bench asks for it
BENCH_RUN = ["train.lr_end_factor=1.0", "run.log=quiet", "run.report=false",
             "run.eval_every=100000"]


def train_to_budget(config: str | None, overrides: list[str], tokens: float, eval_every: int,
                    observe: Callable | None = None, eval_tokens: float | None = None) -> dict:
    """Build a Run and step it until `tokens` generated tokens are decoded, evaluating
    held-out pass@1 at the start, every `eval_every` steps (or, with eval_tokens, after the
    first step that passes each further eval_tokens decoded tokens) and at the end (not
    timed); observe(run, step_result, metrics) after each step. Returns its steps, tokens,
    seconds (generation + training) and the curve of {step, tokens, seconds, pass1}."""

    with Run(load_config(config, overrides + ["train.steps=100000"]), Progress("quiet")) as run:
        curve = [{"step": 0, "tokens": 0, "seconds": 0.0, "pass1": run.evaluate()["eval/pass1"]}]
        used, seconds, step = 0, 0.0, 0
        while used < tokens:
            step += 1
            t0 = time.time()
            r = run.step(step)
            seconds += time.time() - t0
            m = step_metrics(r)
            used += m["tokens/decoded"]
            if observe:
                observe(run, r, m)
            due = (used // eval_tokens > (used - m["tokens/decoded"]) // eval_tokens
                   if eval_tokens else step % eval_every == 0)
            if due or used >= tokens:
                curve.append({"step": step, "tokens": used, "seconds": seconds,
                              "pass1": run.evaluate()["eval/pass1"]})
        return {"steps": step, "tokens": used, "seconds": seconds, "curve": curve}
