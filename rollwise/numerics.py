"""Bit-reproducible CPU arithmetic on a loaded machine.

torch's CPU matrix products in float32 go to MKL on x86. With more than one thread, MKL may
split a product and add the parts in an order that depends on how its threads were scheduled:
on a quiet machine the order repeats, beside other busy processes it does not, and two runs
with the same seed differ in the last bits of their first update. MKL's conditional numerical
reproducibility in strict mode (MKL_CBWR=AUTO,STRICT: the fastest code path for the CPU, the
order fixed for a given number of threads) removes that. MKL reads the setting before its
first product, so rollwise sets it when it is imported, unless MKL_CBWR is already set; a
process that ran MKL products before importing rollwise is checked when a run starts.
"""

from __future__ import annotations

import ctypes
import os

STRICT = 0x10000  # MKL_CBWR_STRICT, as mkl_cbwr_get reports it
ALL = -1  # MKL_CBWR_ALL: ask for the whole setting


def choose_strict_mkl() -> None:
    """Ask MKL, before its first use in this process (and its children), for strict mode."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def mkl_is_strict() -> bool | None:
    """Whether this process's MKL runs in strict reproducible mode; None where torch carries
    no MKL (ARM, a build without it) or its setting cannot be read."""
    import torch
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                       "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get  # MKL's mkl_cbwr_get, as torch's build exports it
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return bool(get(ALL) & STRICT)


def reproducibility_note(threads: int) -> str | None:
    """A line to say at a run's start when same-seed runs may differ under load, else None."""
    if threads <= 1 or mkl_is_strict() is not False:
        return None
    return (f"MKL is not in strict reproducible mode (MKL_CBWR={os.environ.get('MKL_CBWR')!r}"
            f", or MKL ran before rollwise was imported): at {threads} threads two runs with "
            f"the same seed may differ in their last bits on a loaded machine. Set "
            f"MKL_CBWR=AUTO,STRICT before starting Python, or run.threads=1")
