"""run.device: where the trainer and the built-in engine run. Nothing here initialises CUDA on a
machine without it (torch.cuda.is_available only asks the driver)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

from rollwise.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """cpu, cuda (an error naming the fix when torch sees none), or auto (cuda when visible)."""
    if name == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"run.device = cuda, but torch {torch.__version__} ({build}) sees no "
                         "CUDA device: set run.device=cpu (or auto), or install a CUDA build of "
                         "torch on a machine with a GPU")
    if name not in ("auto", "cuda"):
        raise ConfigError(f"run.device = {name!r}: use auto, cpu or cuda")
    return torch.device("cuda" if has_cuda else "cpu")


def _cpu_capabilities() -> dict:
    """torch's reading of the CPU (its name, instruction sets); empty where torch has none."""
    return torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}


def native_bf16(device: str) -> bool:
    """Whether run.device (auto, cpu, cuda) multiplies bfloat16 in hardware: a CUDA GPU that
    supports it, or an x86 CPU with AVX512-BF16 or AMX (oneDNN's bf16 kernels). Elsewhere
    bf16 is emulated and slower than float32, so auto keeps float32."""
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    caps = _cpu_capabilities()
    return bool(torch.backends.mkldnn.is_available() and
                (caps.get("avx512_bf16") or caps.get("amx_bf16")))


@functools.cache
def machine() -> str:
    """What a measurement ran on, for its record ("AMD EPYC, 2 cores, avx512_bf16";
    "NVIDIA H200"): seconds and speed-ups are only compared on one machine."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    caps = _cpu_capabilities()
    fast = [k for k in ("amx_bf16", "avx512_bf16") if caps.get(k)]
    return ", ".join([caps.get("cpu_name") or "CPU", f"{os.cpu_count()} cores", *fast[:1]])


_MMAP_THRESHOLD, _TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks up to 32 MiB (its largest mmap threshold) for reuse instead
    of returning them to the OS. Without it each step's large temporaries (a decode step's
    (batch, vocabulary) log-probabilities, activations) come from fresh pages, and faulting them
    in cost more than the arithmetic: sampling 64 rows of a 49k vocabulary took 22 ms instead of
    6 ms on a 2-core CPU. Process-wide and idempotent; False where the C library is not glibc."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_MMAP_THRESHOLD, 32 << 20) and
                    libc.mallopt(_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim) after a one-off peak
    whose freed blocks keep_freed_memory would otherwise hold for the rest of the process:
    an in-process SFT warm start of SmolLM2 left a 13 GiB floor under the RL run after it.
    False where the C library is not glibc."""
    if sys.platform != "linux":
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
