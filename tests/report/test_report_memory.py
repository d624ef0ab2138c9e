"""Peak resident memory per phase (rollwise/report/memory.py): the phase that sets the
process's peak reads the kernel's high-water mark, a phase below it the sampled RSS, each
against what /proc says independently, and the loop's metrics carry every phase."""

import json
import subprocess
import sys
import time

import pytest

from rollwise.report import memory as M
from rollwise.report.progress import Progress

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
MIB = 2 ** 20


def held(mib: int) -> bytearray:
    """`mib` MiB that are resident (every page written)."""
    block = bytearray(mib * MIB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    return block


SETS_THE_PEAK = """
import json, time
from rollwise.report import memory as M
def held(mib):
    block = bytearray(mib * 2 ** 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    return block
memory = M.PhaseMemory()
memory.close_phase("")
base = M.resident_bytes()
block = held(400)
del block
memory.close_phase("big")
mark = M.high_water_bytes()
small = held(100)
time.sleep(0.2)  # a few samples while it is held
del small
memory.close_phase("small")
got = memory.take()
print(json.dumps({"got": got, "base": base, "mark": mark, "again": memory.take(),
                  "hwm": M.high_water_bytes()}))
"""


def test_a_phase_that_sets_the_peak_reads_the_kernels_high_water_mark():
    """In a fresh process (a long-lived one's earlier peak may be higher than the phase's)."""
    out = subprocess.run([sys.executable, "-c", SETS_THE_PEAK], capture_output=True, text=True,
                         timeout=120, check=True)
    r = json.loads(out.stdout)
    got, base, mark = r["got"], r["base"], r["mark"]
    assert got["memory/phase/big_peak_gib"] * M.GIB == mark  # the kernel's own number
    assert mark >= base + 390 * MIB  # the base itself may lose a few pages meanwhile
    small_peak = got["memory/phase/small_peak_gib"] * M.GIB
    assert base + 90 * MIB <= small_peak < mark  # sampled: it held ~100 MiB over the base
    assert got["memory/peak_gib"] * M.GIB >= mark
    assert r["again"] == {"memory/peak_gib": r["hwm"] / M.GIB}  # taken: reset


def test_a_phase_entered_twice_keeps_its_larger_peak_and_unnamed_time_is_not_booked():
    memory = M.PhaseMemory()
    memory.close_phase("")
    base = M.resident_bytes()
    block = held(100)
    time.sleep(0.1)
    del block
    memory.close_phase("score")
    first = memory.take()["memory/phase/score_peak_gib"] * M.GIB
    block = held(250)
    time.sleep(0.1)
    del block
    memory.close_phase("")  # between phases: counted in the process's peak only
    memory.close_phase("score")
    block = held(150)
    time.sleep(0.1)
    memory.close_phase("score")
    del block
    time.sleep(0.05)
    memory.close_phase("score")
    second = memory.take()
    memory.close()
    assert set(second) == {"memory/phase/score_peak_gib", "memory/peak_gib"}
    assert base + 90 * MIB <= first < base + 200 * MIB
    assert base + 140 * MIB <= second["memory/phase/score_peak_gib"] * M.GIB < base + 240 * MIB


def test_progress_hands_the_loop_seconds_and_memory_per_phase():
    p = Progress("quiet", total=1)
    p.phase("generate")
    block = held(50)
    p.phase("train")
    del block
    out = p.take_phase_metrics()
    p.close()
    assert {"perf/phase/generate_seconds", "memory/phase/generate_peak_gib",
            "memory/phase/train_peak_gib", "memory/peak_gib"} <= set(out)
    resident = M.resident_bytes() / M.GIB
    assert 0 < out["memory/phase/train_peak_gib"] <= out["memory/peak_gib"]
    assert out["memory/peak_gib"] >= resident - 0.01


def test_the_process_peak_is_never_below_a_phase_peak_read_before_it(monkeypatch):
    """The kernel's counters are approximate: an RSS read can pass the high-water mark read
    after it. The process's peak reported is then the read."""
    memory = M.PhaseMemory()
    memory.saw(M.high_water_bytes() + 300 * 1024)  # a read a few pages above the mark
    memory.close_phase("train")
    out = memory.take()
    memory.close()
    assert out["memory/peak_gib"] == out["memory/phase/train_peak_gib"]
    assert out["memory/peak_gib"] * M.GIB > M.high_water_bytes()
