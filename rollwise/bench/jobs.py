"""Bench runs side by side: each in its own process (one torch thread each), each result
appended to a JSONL log as it finishes, and a failing run reported with its traceback
instead of losing the others."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Callable


def _guarded(fn: Callable[..., dict], job: tuple, label: dict) -> dict:
    try:
        return fn(*job)
    except Exception:
        err = traceback.format_exc()
        print(f"{label} FAILED:\n{err}", file=sys.stderr, flush=True)
        return {**label, "error": err}


def execute(fn: Callable[..., dict], jobs: list[tuple], n_jobs: int, log: Path,
            label: Callable[[tuple], dict]) -> tuple[list[dict], list[dict]]:
    """fn(*job) for every job (fn a module-level function, for the worker processes), n_jobs
    side by side. label(job) names a job in its failure record. Returns (finished results,
    failure records), in the order they finished."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    results = []

    def keep(r: dict) -> None:
        results.append(r)
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
    if n_jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(n_jobs, mp_context=mp.get_context("spawn")) as pool:
            for f in as_completed([pool.submit(_guarded, fn, j, label(j)) for j in jobs]):
                keep(f.result())
    else:
        for j in jobs:
            keep(_guarded(fn, j, label(j)))
    return [r for r in results if "error" not in r], [r for r in results if "error" in r]


def warm_start_folder(config: str | None, overrides: list[str], root: str) -> str:
    """The SFT warm start of this config (cached by its config under root/.cache), saved as a
    model folder that runs load with run.init."""
    from rollwise import models
    from rollwise.config import load_config
    from rollwise.tasks import load_task
    from rollwise.training.sft import cache_path, warm_start
    cfg = load_config(config, overrides + [f"run.root={root}"])
    model, tok = warm_start(cfg, load_task(cfg.task),
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    path = f"{cache_path(cfg)}-model"
    models.save(model, tok, path)
    return path
