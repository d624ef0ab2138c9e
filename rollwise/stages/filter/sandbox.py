"""Run untrusted, model-written Python in a sandbox and get its output with a status and reason.

    result = run_python("print(input()[::-1])", stdin="abc\\n", limits=SandboxLimits())
    result.status, result.stdout          # 'ok', 'cba\\n'

Each run goes through a fresh supervisor process (_supervisor.py) that starts the program in
its own session and process group, as an unprivileged uid of its own when we are root, with
CPU-time, address-space, file-size, process-count and open-file limits, a scrubbed
environment, a private temporary directory (removed afterwards), no network (a new network
namespace where the kernel allows it, else Landlock TCP rules plus the in-interpreter guard)
and Landlock filesystem rules. On a timeout the whole group is killed, then every leftover
descendant (daemons reparent to the supervisor). `isolation_report()` says which applied.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

SUPERVISOR = Path(__file__).with_name("_supervisor.py")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 2.0  # wall clock, then the whole process group is killed
    cpu_s: int = 2  # RLIMIT_CPU (SIGXCPU)
    memory_mb: int = 512  # RLIMIT_AS
    max_file_kb: int = 1024  # RLIMIT_FSIZE: largest file the program may write
    max_processes: int = 4  # RLIMIT_NPROC for the sandbox uid (threads count)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_kb: int = 256  # stdout and stderr are each cut here and the program killed
    guard: bool = True  # the in-interpreter audit-hook guard (a second layer, clear reasons)
    network: Literal["auto", "namespace", "socket"] = "auto"
    """auto: a network namespace if the kernel allows one, else socket-level blocking;
    namespace: fail when none is possible; socket: skip the namespace (tests the fallback)."""
    tmp_root: str | None = None  # where private directories are made (default: system temp)


@dataclass
class SandboxResult:
    status: str  # ok, error, blocked, timeout, cpu_time, memory, file_size, output_limit,
    #              killed, sandbox_error
    reason: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    blocked: list[str] = field(default_factory=list)  # what the guard refused
    wall_s: float = 0.0
    cpu_s: float = 0.0
    leftovers_killed: int = 0  # processes still alive after the program ended, now killed
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               in_process: bool = False) -> SandboxResult:
    """Run `code` as a Python program in the sandbox; never raises for what the code does.

    in_process=True makes the calling process the supervisor (one interpreter start less per
    run). Only for a dedicated single-threaded process, such as a Filter pool worker: it
    becomes the child subreaper and kills every descendant it finds after each run."""
    job = {**asdict(limits), "code": code, "stdin": stdin}
    job["cpu_s"] = max(1, int(limits.cpu_s))
    if in_process:
        data = _supervisor_module().supervise(job)
        return SandboxResult(**{k: v for k, v in data.items()
                                if k in SandboxResult.__dataclass_fields__})
    # the supervisor enforces the limits itself; this outer timeout only guards the supervisor
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-B", str(SUPERVISOR)],
                              input=json.dumps(job), capture_output=True, text=True,
                              timeout=limits.timeout_s + 30)
        data = json.loads(proc.stdout)
    except subprocess.TimeoutExpired:
        return SandboxResult("sandbox_error", "the supervisor did not answer in time")
    except json.JSONDecodeError:
        return SandboxResult("sandbox_error", f"supervisor failed: {proc.stderr[-500:]}")
    return SandboxResult(**{k: v for k, v in data.items()
                            if k in SandboxResult.__dataclass_fields__})


@lru_cache(maxsize=None)
def _supervisor_module():
    """_supervisor.py imported by path, as the standalone supervisor sees itself."""
    spec = importlib.util.spec_from_file_location("_rollwise_supervisor", SUPERVISOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def isolation_report(network: str = "auto") -> dict:
    """Which mechanisms a sandboxed program gets on this machine (runs one trivial program)."""
    result = run_python("pass", limits=SandboxLimits(network=network))  # type: ignore[arg-type]
    if result.status != "ok":
        raise RuntimeError(f"the sandbox does not work here: {result.reason}")
    return result.isolation
