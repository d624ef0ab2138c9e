"""Sandbox supervisor: runs one untrusted Python program under every confinement the machine
offers, then kills whatever it left and deletes its directory. Standard library only; run as

    python -I -S -B _supervisor.py  < job.json  > result.json

It is a process of its own so that it can be the child subreaper (orphaned daemons of the
program come back to it and die with it) without touching the caller. See docs/filter.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """A sibling file as a module, without the rollwise package or a sys.path change."""
    path = os.path.join(HERE, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_rollwise_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_confine = _sibling("_confine")
with open(os.path.join(HERE, "_guard.py")) as _f:
    GUARD_SOURCE = _f.read()
SYSTEM_READ = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime",
               "/dev/urandom", "/dev/random", "/dev/zero"]


def plan(job: dict) -> dict:
    """Decide, in the supervisor, which mechanisms apply and with which interpreter."""
    root = os.geteuid() == 0
    python, prefix = sys.executable, sys.base_prefix
    drop_uid = None
    if root:
        if not _confine.others_can_run(python, prefix):
            python, prefix = job.get("fallback_python") or "/usr/bin/python3", "/usr"
        if _confine.others_can_run(python, prefix):
            drop_uid = _confine.SANDBOX_UID_BASE + os.getpid()
        else:
            python, prefix = sys.executable, sys.base_prefix
    abi = _confine.landlock_abi() if job.get("landlock", True) else 0
    nproc = job["max_processes"]
    if drop_uid is None:  # the count is per uid: leave room for what this user already runs
        nproc += _confine.processes_of_uid(os.getuid())
    return {"python": os.path.realpath(python), "prefix": os.path.realpath(prefix),
            "drop_uid": drop_uid, "landlock_abi": abi, "nproc": nproc,
            "network": job.get("network", "auto"),
            "nproc_enforced": drop_uid is not None or not root}


def make_confine(job: dict, p: dict, work: str):
    """The function run in the child between fork and exec."""
    read = SYSTEM_READ + [p["prefix"]]
    execute = [p["python"]] + [x for x in [_confine.elf_interpreter(p["python"])] if x]
    mem = job["memory_mb"] << 20

    def confine() -> None:
        _confine.set_limits(job["cpu_s"], mem, job["max_file_kb"] << 10, p["nproc"],
                            job["max_open_files"])
        if p["network"] in ("auto", "namespace"):
            try:
                _confine.unshare_network()
            except OSError:
                if p["network"] == "namespace":
                    raise
        if p["drop_uid"] is not None:
            _confine.drop_privileges(p["drop_uid"])
        if p["landlock_abi"]:
            _confine.landlock_restrict(p["landlock_abi"], read, [work, "/dev/null"], execute,
                                       block_tcp=True)
    return confine


def describe(p: dict, netns: str | None, guard: bool) -> dict:
    """The kernel mechanisms that applied (the guard, when on, comes on top of them)."""
    abi, own_uid = p["landlock_abi"], p["drop_uid"] is not None
    return {"network": netns or ("landlock-tcp" if abi >= 4 else "none"),
            "filesystem": "landlock" if abi else ("uid" if own_uid else "none"),
            "signals": "landlock-scope" if abi >= 6 else ("uid" if own_uid else "none"),
            "landlock_abi": abi, "uid": p["drop_uid"] if own_uid else os.getuid(),
            "nproc_enforced": p["nproc_enforced"], "guard": guard, "python": p["python"]}


_NETNS: list = []  # probed once per process


def probe_network(job: dict, p: dict) -> str | None:
    """Which network namespace the child will get (tried in a throwaway fork), or None."""
    if p["network"] == "socket":
        return None
    if not _NETNS:
        _NETNS.append(_probe_network())
    return _NETNS[0]


def _probe_network() -> str | None:
    pid = os.fork()
    if pid == 0:
        try:
            kind = _confine.unshare_network()
            os._exit({"netns": 10, "userns+netns": 11}[kind])
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return {10: "netns", 11: "userns+netns"}.get(os.waitstatus_to_exitcode(status))


def descendants(root_pid: int) -> list[int]:
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [root_pid]
    while frontier:
        kids = [pid for pid, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def kill_everything(proc: subprocess.Popen) -> int:
    """SIGKILL the program's process group and every descendant of this supervisor (orphans
    reparent here as we are the subreaper), until none is left. Returns how many were killed."""
    killed = 0
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(200):
        pids = descendants(os.getpid())
        alive = [pid for pid in pids if not _is_zombie(pid)]
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += pid != proc.pid
            except ProcessLookupError:
                pass
        _reap()
        if not alive:
            break
        time.sleep(0.005)
    return killed


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pump(proc: subprocess.Popen, job: dict) -> tuple[bytes, bytes, str | None, float]:
    """Read stdout/stderr until the program exits, its time is up, or it writes too much."""
    limit = job["max_output_kb"] << 10
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    t0 = time.monotonic()
    deadline, why = t0 + job["timeout_s"], None
    exited_at = None
    while sel.get_map():
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.05:
            break  # the program is done; a leftover child holding the pipes does not count
        if now >= deadline:
            why = "timeout"
            break
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf += chunk[:max(0, limit + 1 - len(buf))]
            if len(buf) > limit:
                why = "output_limit"
        if why:
            break
    if why is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            why = "timeout"
    return bytes(bufs[proc.stdout][:limit]), bytes(bufs[proc.stderr][:limit]), why, \
        time.monotonic() - t0


def classify(rc: int | None, why: str | None, stderr: str, cpu_s: float, job: dict,
             blocked: list[str]) -> tuple[str, str]:
    """(status, reason) for the caller; status is one of ok, error, blocked, timeout,
    cpu_time, memory, file_size, output_limit, killed."""
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if why == "output_limit":
        return why, f"output over {job['max_output_kb']} KiB, truncated and killed"
    if why == "timeout":
        return why, f"wall-clock timeout after {job['timeout_s']} s; process group killed"
    if rc is not None and rc < 0:
        sig = signal.Signals(-rc).name
        # SIGXCPU comes only from RLIMIT_CPU, whatever CPU time a loaded machine measured;
        # SIGKILL is the limit's hard stop only when the time was used
        if -rc == signal.SIGXCPU or (-rc == signal.SIGKILL and cpu_s >= job["cpu_s"] - 0.05):
            return "cpu_time", f"CPU time limit {job['cpu_s']} s ({sig})"
        if -rc == signal.SIGXFSZ:
            return "file_size", f"file size limit {job['max_file_kb']} KiB ({sig})"
        return "killed", f"killed by {sig}" + (" (stack overflow)" if sig == "SIGSEGV" else "")
    if rc == 0:
        return "ok", "exit 0"
    if "MemoryError" in last:
        return "memory", f"memory limit {job['memory_mb']} MiB: {last}"
    if "File too large" in last:
        return "file_size", f"file size limit {job['max_file_kb']} KiB: {last}"
    if blocked:
        return "blocked", "refused: " + ", ".join(dict.fromkeys(blocked)) + f"; {last}"
    return "error", f"exit {rc}: {last}"


def supervise(job: dict) -> dict:
    p = plan(job)
    netns = probe_network(job, p)
    if p["network"] == "namespace" and netns is None:
        return {"status": "sandbox_error", "reason": "no network namespace on this machine"}
    work = tempfile.mkdtemp(prefix="rw-sbx-", dir=job.get("tmp_root") or None)
    try:
        return _run_in(work, job, p, netns)
    finally:
        shutil.rmtree(work, onerror=_force_remove)


def _force_remove(func, path, exc_info) -> None:
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass


def _run_in(work: str, job: dict, p: dict, netns: str | None) -> dict:
    program = os.path.join(work, "prog.py")
    with open(program, "w") as f:
        f.write(job["code"])
    with open(os.path.join(work, "input.txt"), "w") as f:
        f.write(job.get("stdin", ""))
    if p["drop_uid"] is not None:
        for path in (work, program):
            os.chown(path, p["drop_uid"], p["drop_uid"])
    marker = "##rw-sandbox-refused-" + secrets.token_hex(8)
    argv = [p["python"], "-I", "-S", "-B"]
    argv += ["-c", GUARD_SOURCE, work, os.pathsep.join(SYSTEM_READ + [p["prefix"]]), marker,
             program] if job.get("guard", True) else [program]
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
    _confine.set_child_subreaper()
    t_usage = os.times()
    try:
        with open(os.path.join(work, "input.txt"), "rb") as stdin:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=work, env=env,
                                    start_new_session=True,
                                    preexec_fn=make_confine(job, p, work))
    except (OSError, subprocess.SubprocessError) as e:
        return {"status": "sandbox_error", "reason": f"could not start the sandbox: {e}"}
    out, err, why, wall = pump(proc, job)
    rc = proc.poll()
    leftovers = kill_everything(proc)
    t_end = os.times()
    cpu = (t_end.children_user - t_usage.children_user) + \
        (t_end.children_system - t_usage.children_system)
    stderr = err.decode("utf-8", "replace")
    blocked = [line.split(" ", 1)[1] for line in stderr.splitlines()
               if line.startswith(marker + " ")]
    stderr = "\n".join(line for line in stderr.splitlines() if not line.startswith(marker))
    status, reason = classify(rc, why, stderr, cpu, job, blocked)
    return {"status": status, "reason": reason, "returncode": rc,
            "stdout": out.decode("utf-8", "replace"), "stderr": stderr, "blocked": blocked,
            "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "leftovers_killed": leftovers,
            "isolation": describe(p, netns, job.get("guard", True))}


def main() -> int:
    job = json.load(sys.stdin)
    try:
        result = supervise(job)
    except Exception as e:  # report, never hang the caller
        result = {"status": "sandbox_error", "reason": f"supervisor: {type(e).__name__}: {e}"}
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
