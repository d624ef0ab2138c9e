"""torch's compile cache, kept usable across interrupted starts.

Inductor writes each compiled kernel as a shared object in its cache (TORCHINDUCTOR_CACHE_DIR,
else /tmp/torchinductor_<user>), the C++ compiler writing straight to the final path. A
process killed mid-compile (Ctrl-C or kill during a first start) leaves that file empty or
cut short, and every later start that finds it dies in `generate()` ("file too short", or a
C++ error on a damaged precompiled header). Before the decode graph compiles, such files are
removed, so the compile builds them again; and if a compile or load fails anyway, the engine
falls back to the uncompiled decode graph with a message naming this cache.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
_repaired: set[Path] = set()  # caches already swept by this process


def cache_dir() -> Path:
    """Where inductor keeps its compiled kernels in this process."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    return Path(inductor_cache_dir())


def is_damaged(path: Path) -> bool:
    """A shared object that is empty, not ELF, or shorter than its own headers say (its
    section header table is at the end of the file, where a cut-short write never got)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False  # being written or removed by another process: not ours to judge
    if size == 0 or head[:4] != ELF_MAGIC or len(head) < 64:
        return True
    if head[4] != 2:  # 32-bit ELF: only the magic is checked
        return False
    endian = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(endian + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(endian + "HH", head, 0x3A)
    return size < shoff + shentsize * shnum


def repair(root: Path | None = None) -> list[Path]:
    """Remove the damaged shared objects under the cache (`root`, default cache_dir()), once
    per process and cache; returns them. Files newer than a minute are left alone: another
    process may be writing them now."""
    root = cache_dir() if root is None else root
    removed: list[Path] = []
    if root in _repaired or not root.is_dir():
        return removed
    _repaired.add(root)
    recent = time.time() - 60
    for path in root.rglob("*.so"):
        try:
            if path.stat().st_mtime > recent or not is_damaged(path):
                continue
            os.remove(path)
            removed.append(path)
        except OSError:
            continue
    return removed
