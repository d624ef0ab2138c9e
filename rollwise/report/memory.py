"""Peak resident memory per phase of a run, as the kernel counts it.

    memory = PhaseMemory()           # sampled by one thread for the process, where /proc is
    memory.close_phase("generate")   # at each phase change: books the phase just ended
    memory.take()  # {"memory/phase/generate_peak_gib": 1.2, "memory/peak_gib": 1.5}

The process's high-water mark (VmHWM, what `/usr/bin/time` and getrusage report) is never
reset, so tools outside keep seeing the true peak. A phase that raised it gets the kernel's
new mark, which is exact: nothing before it reached as high. A phase below the mark gets the
largest RSS a thread read from /proc/self/statm every SAMPLE_S seconds while it ran (a
transient shorter than that can be missed; it cannot have set the run's peak). Where /proc is
missing (macOS), only the high-water mark is reported, from getrusage. The kernel's RSS
counters are approximate by a few hundred KiB (per-CPU counts), so a read can pass the mark
taken after it: the process's peak is the larger of the two.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
import weakref

SAMPLE_S = 0.01
GIB = 2 ** 30
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def high_water_bytes() -> int:
    """The process's peak RSS so far (the kernel's high-water mark)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes


def resident_bytes() -> int | None:
    """The process's RSS now, or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


class _Sampler:
    """One thread for the process, reading RSS every SAMPLE_S seconds for every PhaseMemory
    open (it ends when none is)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._watchers: weakref.WeakSet = weakref.WeakSet()
        self._running = False

    def add(self, watcher: "PhaseMemory") -> None:
        with self._lock:
            self._watchers.add(watcher)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, daemon=True, name="rollwise-memory").start()

    def remove(self, watcher: "PhaseMemory") -> None:
        with self._lock:
            self._watchers.discard(watcher)

    def _run(self) -> None:
        while True:
            time.sleep(SAMPLE_S)
            now = resident_bytes()
            with self._lock:
                watchers = list(self._watchers)
                if now is None or not watchers:
                    self._running = False
                    return
            for w in watchers:
                w.saw(now)


_SAMPLER = _Sampler()


class PhaseMemory:
    """Books each phase's peak RSS; see the module docstring."""

    def __init__(self):
        self._lock = threading.Lock()
        self._mark = high_water_bytes()  # the high-water mark when the current phase began
        self._sampled = resident_bytes() or 0  # the largest RSS read in the current phase
        self._peaks: dict[str, int] = {}
        self._highest = 0  # the largest phase peak booked
        if self._sampled:
            _SAMPLER.add(self)

    def saw(self, resident: int) -> None:
        with self._lock:
            self._sampled = max(self._sampled, resident)

    def close_phase(self, name: str) -> None:
        """Book the phase that just ended under `name` (none: "") and start the next one."""
        mark = high_water_bytes()
        with self._lock:
            now = resident_bytes() or 0
            peak = mark if mark > self._mark else max(self._sampled, now)
            if name and peak:
                self._peaks[name] = max(self._peaks.get(name, 0), peak)
                self._highest = max(self._highest, peak)
            self._mark, self._sampled = mark, now

    def take(self) -> dict[str, float]:
        """Each phase's peak since the last call (GiB), and the process's peak so far."""
        with self._lock:
            out = {f"memory/phase/{k}_peak_gib": v / GIB for k, v in self._peaks.items()}
            self._peaks = {}
            highest = self._highest
        out["memory/peak_gib"] = max(high_water_bytes(), highest) / GIB
        return out

    def close(self) -> None:
        _SAMPLER.remove(self)
