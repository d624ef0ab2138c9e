"""Metric sinks: where each step's metrics go.

`metrics.jsonl` is always written (the report and `rollwise report` read it); TensorBoard
event files when tensorboard is installed and `run.tensorboard` is on; Weights & Biases when
wandb is installed and `run.wandb=true`; and any user sink named by import path in
`run.sinks` ('package.module:factory', called as factory(run_dir, cfg) -> MetricSink).

    sinks = build_sinks(cfg, run_dir, log=print)
    sinks.write(step, {"reward/mean": 0.4})
    sinks.close()
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from rollwise.report.data import read_metrics
from rollwise.stages.filter import import_object
from rollwise.store.fsio import atomic_write


@runtime_checkable
class MetricSink(Protocol):
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics (numbers, and possibly a few strings)."""

    def close(self) -> None:
        """Flush and release; called once at the end of the run."""


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries (bools as 0/1): what plotting backends can take."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class JsonlSink:
    """One JSON object per line, flushed at once so a crash keeps every finished step."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        """resume_step: continue an existing file, keeping only its rows up to that step
        (a resumed run writes the later steps again)."""
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in rows).encode())
        self._f = open(self.path, "a" if resume_step is not None else "w")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()

    def sync(self) -> None:
        """On disk for good (fsync): before a checkpoint, so a power loss cannot leave the
        metrics short of the step a resume starts from."""
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardSink:
    """Scalars under their metric names in <run>/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        # optional: only when the sink is configured
        from torch.utils.tensorboard import SummaryWriter
        self.logdir = Path(logdir)
        self._w = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in scalars(metrics).items():
            if k != "step":
                self._w.add_scalar(k, v, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """One wandb run per rollwise run; offline mode works without a network (WANDB_MODE)."""

    def __init__(self, run_dir: Path, cfg, project: str):
        # optional: only when the sink is configured
        import wandb
        self._run = wandb.init(project=project, name=cfg.run.name, dir=str(run_dir),
                               config=cfg.model_dump(mode="json"), reinit=True)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in scalars(metrics).items() if k != "step"}, step=step)

    def close(self) -> None:
        self._run.finish()


def load_user_sink(path: str, run_dir: Path, cfg) -> MetricSink:
    """Instantiate 'package.module:factory' as factory(run_dir, cfg); check the protocol."""
    try:
        factory: Callable = import_object(path)
    except ValueError as e:
        raise ValueError(f"run.sinks: {e}") from None
    sink = factory(run_dir, cfg)
    if not isinstance(sink, MetricSink):
        raise ValueError(f"run.sinks: {path!r} returned {type(sink).__name__}, which lacks "
                         "write(step, metrics) and close(); return an object with both")
    return sink


class Sinks:
    """Fans each step out to every sink. A failing optional sink is reported once and
    dropped, so a full disk for TensorBoard or a W&B outage never stops training; the jsonl
    sink is the record, and its failures propagate."""

    def __init__(self, primary: JsonlSink, extra: list[MetricSink], log=print):
        self.primary, self.extra, self.log = primary, list(extra), log

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.primary.write(step, metrics)
        for sink in list(self.extra):
            try:
                sink.write(step, metrics)
            except Exception as e:  # an optional sink must not stop the run
                self.log(f"metric sink {type(sink).__name__} failed and is dropped: "
                         f"{type(e).__name__}: {e}")
                self.extra.remove(sink)

    def sync(self) -> None:
        """The record (metrics.jsonl) on disk for good; called before each checkpoint."""
        self.primary.sync()

    def close(self) -> None:
        for sink in [self.primary, *self.extra]:
            try:
                sink.close()
            except Exception as e:
                self.log(f"metric sink {type(sink).__name__} failed to close: {e}")


def build_sinks(cfg, run_dir: str | Path, log=print, resume_step: int | None = None) -> Sinks:
    """The sinks a run's config asks for; an optional backend that is not installed is
    skipped with one line of log (W&B only when asked for, TensorBoard when installed).
    resume_step: a resumed run; metrics.jsonl and TensorBoard drop the steps after it."""
    run_dir, r = Path(run_dir), cfg.run
    extra: list[MetricSink] = []
    if r.tensorboard and tensorboard_available():
        purge = None if resume_step is None else resume_step + 1
        extra.append(TensorBoardSink(run_dir / "tensorboard", purge))
    if r.wandb:
        if importlib.util.find_spec("wandb") is None:
            log("run.wandb=true but wandb is not installed (pip install wandb): skipped")
        else:
            extra.append(WandbSink(run_dir, cfg, r.wandb_project))
    extra += [load_user_sink(path, run_dir, cfg) for path in r.sinks]
    return Sinks(JsonlSink(run_dir / "metrics.jsonl", resume_step), extra, log)
