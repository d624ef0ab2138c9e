"""Live progress: a rich bar on a terminal, one plain line per step in logs and CI, or quiet.

The display shows the step, the phase the loop is in (generate / score / train / sync / eval),
reward, held-out pass@1 (the latest evaluation), generated tokens per second, the share of
informative groups (mixed rewards, so a non-zero GRPO advantage), and the time left. The
phase calls also time the phases and book their peak memory: `take_phase_metrics()` hands the
loop each phase's seconds and peak RSS since the last call, as perf/phase/<name>_seconds and
memory/phase/<name>_peak_gib (memory.py), with the process's peak so far, memory/peak_gib.

    progress = Progress("plain", total=60)   # or "rich", "quiet", "auto"

A phase may carry a note, a callable read while it runs ("1,234 tokens"): the rich display
shows it with the phase's elapsed time, and in plain mode a phase that lasts longer than
`heartbeat_s` prints a line every heartbeat_s, so a long generation, update or evaluation is
never silent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from rollwise.report.memory import PhaseMemory

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
    def __init__(self, mode: str = "auto", total: int = 0, stream=None,
                 heartbeat_s: float = 10.0):
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
        self.memory = PhaseMemory()
        self._t_first: float | None = None  # time of the first step() call: the ETA's origin
        self._step_first = 0
        self._bar = None
        self._note: Callable[[], str] | None = None
        self._lock = threading.Lock()  # the heartbeat thread prints between phase changes
        self._stopped = threading.Event()
        if mode == "rich" and total > 0:
            self._start_bar()
        if mode == "plain" and heartbeat_s > 0:
            threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                             name="rollwise-progress").start()

    def _start_bar(self) -> None:
        """Two lines that fit 80 columns: the bar with phase and ETA, then the metrics."""
        # rich: only for a live terminal
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, TextColumn
        from rich.progress import Progress as RichProgress
        from rich.text import Text

        class Info:  # re-read at each refresh
            text = ""

            def __rich__(self):
                return Text(self.text, style="dim")
        self._info = Info()
        progress = self

        class Phase:  # the phase, its elapsed seconds and note, re-read at each refresh
            def __rich__(self):
                return Text(progress.phase_text())
        self._bar = RichProgress(TextColumn("step {task.completed}/{task.total}"),
                                 BarColumn(bar_width=30), TextColumn("eta {task.fields[eta]}"))
        self._task = self._bar.add_task("train", total=self.total, eta="?")
        self._live = Live(Group(self._bar, Phase(), self._info),
                          console=Console(file=self.stream), refresh_per_second=4,
                          transient=False)
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
        self.memory.close_phase(self.current_phase)
        if self.current_phase:
            dt = now - self._phase_t0
            self._phase_seconds[self.current_phase] = \
                self._phase_seconds.get(self.current_phase, 0.0) + dt
        self._phase_t0 = now

    def phase(self, name: str, note: Callable[[], str] | None = None) -> None:
        """The loop enters phase `name`; the previous phase's time is booked. Only the main
        thread's phases are booked: the asynchronous loop's producer generates alongside.
        note(): a few words on the phase's progress, read while it runs."""
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            self._close_phase(time.time())
            self.current_phase, self._note = name, note

    def phase_text(self) -> str:
        """'generate 12s  1,234 tokens': the phase, its elapsed time and its note."""
        with self._lock:
            name, note, t0 = self.current_phase, self._note, self._phase_t0
        if not name:
            return ""
        try:
            extra = note() if note is not None else ""
        except Exception:  # a note is decoration: never let it break the display
            extra = ""
        return f"{name} {time.time() - t0:.0f}s" + (f"  {extra}" if extra else "")

    def _heartbeat(self, every: float) -> None:
        """Plain mode: a line every `every` seconds while one phase lasts."""
        last = None
        while not self._stopped.wait(min(1.0, every)):
            with self._lock:
                key, elapsed = (self.current_phase, self._phase_t0), time.time() - self._phase_t0
            if not key[0] or elapsed < every:
                continue
            due = int(elapsed // every)
            if last != (key, due):
                last = (key, due)
                print(f"  ... {self.phase_text()}", file=self.stream, flush=True)

    def take_phase_metrics(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call, as perf/phase/<name>_seconds, and
        each phase's peak RSS with the process's (memory.py)."""
        with self._lock:
            self._close_phase(time.time())
        out = {f"perf/phase/{k}_seconds": v for k, v in self._phase_seconds.items()}
        self._phase_seconds = {}
        return out | self.memory.take()

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
        with self._lock:
            self._close_phase(time.time())
            self.current_phase, self._note = "", None
        eta = self.eta_seconds(step)
        eta_text = "?" if eta is None else fmt_duration(eta)
        if self._bar is not None:
            self._info.text = info_line(self.last)
            self._bar.update(self._task, completed=step, eta=eta_text)
        elif self.mode == "plain":
            print(f"step {step}/{self.total}  {info_line(self.last)}  eta {eta_text}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        self._stopped.set()
        self.memory.close()
        if self._bar is not None:
            self._live.stop()
            self._bar = None
