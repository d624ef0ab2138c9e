"""keep_freed_memory: after it, glibc keeps a step's large temporaries (up to 32 MiB) in its
heap and does not give freed memory back to the OS, so the next step reuses those pages instead
of faulting fresh ones in (the cost it removes from CPU sampling and training).

Asserted on glibc's own bookkeeping, in a fresh interpreter each way (glibc raises its mmap
threshold by itself after the first large free, so a long-lived worker's history would decide):
a page-fault count is not used, as the kernel may reclaim idle pages of any process."""

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.sbrk.restype = ctypes.c_void_p, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.sbrk.argtypes = [ctypes.c_ssize_t]
if sys.argv[1] == "keep":  # glibc's defaults otherwise, with nothing else imported
    from rollwise.devices import keep_freed_memory
    assert keep_freed_memory() is True and keep_freed_memory() is True  # idempotent
block = libc.malloc(12 << 20)  # a (64, 49152) float32 log-probability table
mmapped = bool(ctypes.c_size_t.from_address(block - 8).value & 2)  # glibc's IS_MMAPPED bit
top = libc.sbrk(0)
libc.free(block)
print(mmapped, libc.sbrk(0) != top)
"""


def _probe(mode: str) -> tuple[bool, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    mmapped, trimmed = out.stdout.split()
    return mmapped == "True", trimmed == "True"


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_freed_blocks_stay_in_the_heap_for_reuse():
    assert _probe("default") == (True, False)  # mapped for itself, unmapped when freed
    assert _probe("keep") == (False, False)  # from the heap, and the heap is not trimmed


RELEASE = """
import ctypes, sys
from rollwise.devices import keep_freed_memory, release_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
keep_freed_memory()
blocks = [libc.malloc(1 << 20) for _ in range(400)]  # 400 MiB in heap-sized blocks
for b in blocks:
    libc.memset(b, 1, 1 << 20)
keep = blocks[-1]  # one live block above the rest: the heap's top cannot simply shrink
for b in blocks[:-1]:
    libc.free(b)
held = rss_mib()
assert release_freed_memory()
print(held, rss_mib())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_released_memory_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                         timeout=120, check=True)
    held, after = map(float, out.stdout.split())
    assert held - after > 300  # MiB: the freed blocks' pages, kept until released
