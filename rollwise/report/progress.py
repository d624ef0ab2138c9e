"""Live progress: a rich bar on a terminal, one plain line per step in logs and CI, or quiet.

The display shows the step, the phase the loop is in (generate / score / train / sync / eval),
reward, held-out pass@1 (the latest evaluation), generated tokens per second, the share of
informative groups (mixed rewards, so a non-zero GRPO advantage), and the time left. The
phase calls also time the phases: `take_phase_seconds()` hands the loop each phase's seconds
since the last call, as perf/phase/<name>_seconds metrics.

    progress = Progress("plain", total=60)   # or "rich", "quiet", "auto"
"""

from __future__ import annotations

import os
import sys
import threading
import time

KEYS = [("reward", "reward/mean", "{:.3f}"), ("pass@1", "eval/pass1", "{:.3f}"),
        ("tok/s", "perf/gen_tokens_per_s", "{:.0f}"),
        ("informative", "groups/mixed_share", "{:.2f}")]
MODES = ("auto", "rich", "plain", "quiet")


def fmt_duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def info_line(metrics: dict[str, float]) -> str:
    """'reward 0.412  pass@1 0.530 ...' for the keys present (absent ones are left out)."""
    return "  ".join(f"{label} {fmt.format(metrics[key])}" for label, key, fmt in KEYS
                     if isinstance(metrics.get(key), (int, float)))


class Progress:
    def __init__(self, mode: str = "auto", total: int = 0, stream=None):
        if mode not in MODES:
            raise ValueError(f"run.log = {mode!r}: choose one of {', '.join(MODES)}")
        self.stream = stream or sys.stdout
        if mode == "auto":
            tty = hasattr(self.stream, "isatty") and self.stream.isatty()
            mode = "rich" if tty and not os.environ.get("CI") else "plain"
        self.mode, self.total = mode, total
        self.last: dict[str, float] = {}
        self.current_phase = ""
        self._phase_t0 = time.time()
        self._phase_seconds: dict[str, float] = {}
        self._t_first: float | None = None  # time of the first step() call: the ETA's origin
        self._step_first = 0
        self._bar = None
        if mode == "rich" and total > 0:
            self._start_bar()

    def _start_bar(self) -> None:
        """Two lines that fit 80 columns: the bar with phase and ETA, then the metrics."""
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn
        from rich.text import Text

        class Info:  # re-read at each refresh
            text = ""

            def __rich__(self):
                return Text(self.text, style="dim")
        self._info = Info()
        self._bar = RichProgress(TextColumn("step {task.completed}/{task.total}"),
                                 BarColumn(bar_width=30), TextColumn("{task.fields[phase]:<8}"),
                                 TextColumn("eta {task.fields[eta]}"))
        self._task = self._bar.add_task("train", total=self.total, phase="", eta="?")
        self._live = Live(Group(self._bar, self._info), console=Console(file=self.stream),
                          refresh_per_second=4, transient=False)
        self._live.start()

    def log(self, msg: str) -> None:
        if self.mode == "quiet":
            return
        if self._bar is not None:
            self._live.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=self.stream, flush=True)

    # ----------------------------------------------------------------------- phases

    def _close_phase(self, now: float) -> None:
        if self.current_phase:
            dt = now - self._phase_t0
            self._phase_seconds[self.current_phase] = \
                self._phase_seconds.get(self.current_phase, 0.0) + dt
        self._phase_t0 = now

    def phase(self, name: str) -> None:
        """The loop enters phase `name`; the previous phase's time is booked. Only the main
        thread's phases are booked: the asynchronous loop's producer generates alongside."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._close_phase(time.time())
        self.current_phase = name
        if self._bar is not None:
            self._bar.update(self._task, phase=name)

    def take_phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call, as perf/phase/<name>_seconds."""
        self._close_phase(time.time())
        out = {f"perf/phase/{k}_seconds": v for k, v in self._phase_seconds.items()}
        self._phase_seconds = {}
        return out

    # ------------------------------------------------------------------------ steps

    def eta_seconds(self, step: int) -> float | None:
        """Time left, from the mean step time since the first step() call (so warm start
        and model loading do not count as training time); None until one step is done."""
        if self._t_first is None or step <= self._step_first:
            return None
        per_step = (time.time() - self._t_first) / (step - self._step_first)
        return per_step * max(self.total - step, 0)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if self._t_first is None:
            self._t_first, self._step_first = time.time(), step
        self.last.update(metrics)
        self._close_phase(time.time())
        self.current_phase = ""
        eta = self.eta_seconds(step)
        eta_text = "?" if eta is None else fmt_duration(eta)
        if self._bar is not None:
            self._info.text = info_line(self.last)
            self._bar.update(self._task, completed=step, eta=eta_text, phase="")
        elif self.mode == "plain":
            print(f"step {step}/{self.total}  {info_line(self.last)}  eta {eta_text}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._live.stop()
            self._bar = None
