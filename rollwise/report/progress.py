"""Live progress: a rich bar on a terminal, one plain line per step in logs and CI, or quiet."""

from __future__ import annotations

import os
import sys
import time

KEYS = [("reward", "reward/mean", "{:.3f}"), ("pass@1", "eval/pass1", "{:.3f}"),
        ("tok/s", "perf/gen_tokens_per_s", "{:.0f}"), ("mixed", "groups/mixed_share", "{:.2f}")]


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


class Progress:
    def __init__(self, mode: str = "auto", total: int = 0):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() and not os.environ.get("CI") else "plain"
        self.mode, self.total = mode, total
        self.start = time.time()
        self.last: dict[str, float] = {}
        self._bar = None
        if mode == "rich" and total > 0:
            from rich.progress import (BarColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn)
            self._bar = RichProgress(TextColumn("step {task.completed}/{task.total}"),
                                     BarColumn(), TextColumn("{task.fields[phase]:<8}"),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total, phase="", info="")
            self._bar.start()

    def log(self, msg: str) -> None:
        if self.mode == "quiet":
            return
        if self._bar is not None:
            self._bar.console.print(msg)
        else:
            print(msg, flush=True)

    def phase(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, phase=name)

    def _info(self) -> str:
        parts = [f"{label} {fmt.format(self.last[key])}" for label, key, fmt in KEYS
                 if key in self.last]
        return "  ".join(parts)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.last.update(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=self._info())
        elif self.mode == "plain":
            elapsed = time.time() - self.start
            eta = elapsed / max(step, 1) * (self.total - step)
            print(f"step {step}/{self.total}  {self._info()}  eta {_fmt_eta(eta)}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
