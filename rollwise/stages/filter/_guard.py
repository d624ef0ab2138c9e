"""In-interpreter guard for sandboxed programs (the supervisor runs this source with
`python -I -S -B -c`): a PEP 578 audit hook, which Python code cannot remove, that refuses
process creation, signals, sockets, ctypes, and file access outside the sandbox directory,
then runs the program. It names what it refused, which gives clear failure reasons.

It is a second layer: the kernel limits (rlimits, network namespace, Landlock, a separate
uid) are the boundary where the machine has them. argv: -c WORKDIR READ_ROOTS MARKER PROGRAM
"""

import os
import sys


def _install(work, read_roots, marker):
    work = os.path.abspath(work)
    reads = tuple(os.path.abspath(p) for p in read_roots.split(os.pathsep) if p) + (work,)
    writes = (work, "/dev/null")
    denied = frozenset((
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
        "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.sendto",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "gc.get_objects", "gc.get_referrers",
        "gc.get_referents", "sys.setprofile", "sys.settrace", "os.setuid", "os.chroot"))
    no_import = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "cffi", "_xxsubinterpreters"))
    write_events = frozenset(("os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod",
                              "os.chown", "os.link", "os.symlink", "os.truncate", "os.utime",
                              "shutil.rmtree", "os.chflags", "os.lchflags", "os.mkfifo",
                              "os.mknod"))
    read_events = frozenset(("os.listdir", "os.scandir"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def refuse(what, _write=os.write, _marker=marker):
        try:
            _write(2, f"\n{_marker} {what}\n".encode())
        except OSError:
            pass
        raise PermissionError(f"sandbox: {what} is not allowed")

    def inside(path, roots, _abspath=os.path.abspath, _fspath=os.fspath):
        if isinstance(path, int) or path is None:
            return True  # an already open descriptor
        p = _fspath(path)
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        if ".." in p.split("/"):
            return False  # no climbing out through dir_fd-relative paths
        p = _abspath(p)
        return any(p == r or p.startswith(r + "/") for r in roots)

    def hook(event, args, _denied=denied, _no_import=no_import, _w=write_events,
             _r=read_events, _wf=write_flags, _reads=reads, _writes=writes):
        if event in _denied:
            refuse(event)
        elif event == "import":
            if args[0].partition(".")[0] in _no_import:
                refuse(f"import {args[0]}")
        elif event == "open":
            path, mode, flags = args
            writing = (flags & _wf) if isinstance(flags, int) else \
                any(c in (mode or "") for c in "wax+")
            if not inside(path, _writes if writing else _reads):
                refuse(f"open {path!r} ({'write' if writing else 'read'})")
        elif event in _w:
            for path in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if not inside(path, _writes):
                    refuse(f"{event} {path!r}")
        elif event in _r and args and not inside(args[0] or ".", _reads):
            refuse(f"{event} {args[0]!r}")

    sys.addaudithook(hook)


def _main():
    work, read_roots, marker, program = sys.argv[1:5]
    with open(program, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, program, "exec")
    sys.argv = [program]
    _install(work, read_roots, marker)
    glb = {"__name__": "__main__", "__file__": program, "__builtins__": __builtins__}
    del globals()["_install"], globals()["_main"]
    exec(code, glb)


_main()
