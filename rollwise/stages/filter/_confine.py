"""Kernel confinement for the code sandbox: rlimits, a private network namespace, an
unprivileged sandbox user, and Landlock. Standard library only: the supervisor imports this
file by path (python -I -S), never the rollwise package.

Everything here either runs in the supervisor (probes) or in the sandboxed child between fork
and exec (`confine`), where only async-signal-safe-ish, allocation-light work belongs.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 38, 36
SANDBOX_UID_BASE = 100_000  # root drops to SANDBOX_UID_BASE + supervisor pid (one uid per run)

# Landlock (Linux 5.13+): same syscall numbers on every architecture since 5.1's unification.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_VERSION = 1 << 0
_LL_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_BITS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}  # number of fs access bits each ABI knows
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)


def _syscall(nr: int, *args) -> int:
    fn = _libc.syscall
    fn.restype = ctypes.c_long
    return fn(ctypes.c_long(nr), *args)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    if platform.system() != "Linux":
        return 0
    v = _syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_VERSION))
    return max(int(v), 0)


def _fs_all(abi: int) -> int:
    return (1 << _FS_BITS_BY_ABI.get(abi, 16)) - 1


def landlock_restrict(abi: int, read: list[str], write: list[str], execute: list[str],
                      block_tcp: bool) -> list[str]:
    """Allow only these paths (read, write = full access beneath, execute = those files);
    block TCP bind/connect (ABI 4+) and signals/abstract sockets leaving the domain (ABI 6+).
    Returns what was applied, for the isolation report."""
    fs_all = _fs_all(abi)
    net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if (block_tcp and abi >= 4) else 0
    scoped = (_SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX) if abi >= 6 else 0
    attr = struct.pack("QQQ", fs_all, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = _syscall(_LL_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read_dir = FS_READ_FILE | FS_READ_DIR
    try:
        run = FS_EXECUTE | FS_READ_FILE
        for paths, rights in ((read, read_dir), (write, fs_all), (execute, run)):
            for path in paths:
                _add_path_rule(fd, path, rights)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
        if _syscall(_LL_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    applied = ["landlock-fs"]
    if net:
        applied.append("landlock-tcp")
    if scoped:
        applied.append("landlock-scope-signal")
    return applied


def _add_path_rule(ruleset_fd: int, path: str, rights: int) -> None:
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a missing optional path (e.g. /lib32) is simply not allowed
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        attr = struct.pack("=Qi", rights, pfd)  # packed struct landlock_path_beneath_attr
        buf = ctypes.create_string_buffer(attr, len(attr))
        if _syscall(_LL_ADD_RULE, ctypes.c_int(ruleset_fd), ctypes.c_int(_LL_RULE_PATH_BENEATH),
                    buf, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
    finally:
        os.close(pfd)


def unshare_network() -> str:
    """Move this process into a fresh network namespace (only a down loopback): directly when
    privileged, else inside a new user namespace. Returns which one worked; raises if none."""
    if _libc.unshare(CLONE_NEWNET) == 0:
        return "netns"
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "userns+netns"
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


def set_child_subreaper() -> None:
    """Orphans of our descendants (double-forked daemons) reparent to us, so we can kill them."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def set_limits(cpu_s: int, memory_bytes: int, file_bytes: int, nproc: int, nofile: int) -> None:
    for res, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
                       (resource.RLIMIT_AS, (memory_bytes, memory_bytes)),
                       (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),
                       (resource.RLIMIT_NPROC, (nproc, nproc)),
                       (resource.RLIMIT_NOFILE, (nofile, nofile)),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)


def drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def processes_of_uid(uid: int) -> int:
    """How many tasks (threads count for RLIMIT_NPROC) this uid runs now."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{pid}")
            if st.st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def others_can_run(executable: str, prefix: str) -> bool:
    """True if a user with no relation to the files could exec `executable` and read `prefix`
    (every directory on the way is world-searchable): needed before dropping to a sandbox uid."""
    def reachable(path: str, need: int) -> bool:
        path = os.path.realpath(path)
        parts = path.split(os.sep)
        for i in range(2, len(parts)):
            d = os.sep.join(parts[:i]) or os.sep
            if not os.stat(d).st_mode & 0o001:
                return False
        return bool(os.stat(path).st_mode & need)
    try:
        return reachable(executable, 0o001) and reachable(prefix, 0o005)
    except OSError:
        return False


def elf_interpreter(executable: str) -> str | None:
    """The dynamic loader named in the executable's PT_INTERP (it needs execute rights too)."""
    try:
        with open(os.path.realpath(executable), "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return None
            end = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack(end + "Q", head[32:40])
            phentsize, phnum = struct.unpack(end + "HH", head[54:58])
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                ph = table[i * phentsize:(i + 1) * phentsize]
                if struct.unpack(end + "I", ph[:4])[0] == 3:  # PT_INTERP
                    off, = struct.unpack(end + "Q", ph[8:16])
                    size, = struct.unpack(end + "Q", ph[32:40])
                    f.seek(off)
                    return os.path.realpath(f.read(size).rstrip(b"\0").decode())
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None
