"""The run's own processes: its namespace's init, and the program that init starts.

`run_init` is PID 1 of a run's PID namespace; it forks the program, which takes its stdio,
uid, capabilities, seccomp filter and rlimits, then runs the source as __main__. Runs in
the server from a staged copy: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading

from .cgroup import join as join_cgroup
from .limits import CHILD_ENV, SandboxLimits, set_rlimits
from .runsetup import (
    M_ARENA_MAX,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    ServerState,
    drop_capabilities,
    libc,
    mount_run_dirs,
    own_user_namespace,
    prctl,
)
from .seccomp import filter_covert_syscalls


def run_init(
    srv: ServerState,
    source: str,
    args: list[str],
    lim: SandboxLimits,
    uid: int,
    workdir: str,
    stdio: tuple[int, int, int, int],
    st_w: int,
    shared_nproc: int,
    binds: dict[str, str],
    cgroup_fd: int | None = None,
) -> None:
    """PID 1 of the run's namespace: join its memory cgroup, mount its private dirs, start
    the program, report how it ended, exit. Exiting makes the kernel kill everything else
    left in the namespace."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor died: take the namespace down
    try:
        if cgroup_fd is not None:
            join_cgroup(cgroup_fd)
        if srv.mountns:
            mount_run_dirs(srv, uid, lim.max_file_mb, binds)
        pid = os.fork()
    except BaseException as exc:
        os.write(stdio[2], f"sandbox: could not start the program: {exc!r}\n".encode())
        raise
    if pid == 0:
        try:
            os.close(st_w)
            _program(srv, source, args, lim, uid, workdir, stdio, shared_nproc)
        except BaseException as exc:
            os.write(2, f"sandbox: could not start the program: {exc!r}\n".encode())
        finally:
            os._exit(127)
    for fd in stdio:
        os.close(fd)
    while True:  # as PID 1 we also reap orphans; only the program's own end matters
        try:
            child, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if child == pid:
            os.write(st_w, b"%d\n" % status)
            os._exit(0)


def _program(
    srv: ServerState,
    source: str,
    args: list[str],
    lim: SandboxLimits,
    uid: int,
    workdir: str,
    stdio: tuple[int, int, int, int],
    shared_nproc: int,
) -> None:
    """Become the program: its stdio, limits and uid, then run the source as __main__."""
    in_r, out_w, err_w, rep_w = stdio
    os.setsid()
    for target, fd in ((0, in_r), (1, out_w), (2, err_w), (3, rep_w)):
        os.dup2(fd, target)
    os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    if srv.uid_per_run:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif srv.mode == "userns":
        if srv.userns_per_run:
            own_user_namespace()
        drop_capabilities(srv.cap_last)  # root of a user namespace, but powerless
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if srv.allow_list:
        filter_covert_syscalls()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.chdir(workdir)
    path = os.path.join(workdir, "main.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(source)
    set_rlimits(lim, shared_nproc, memory_cgroup=bool(srv.cgroup))
    os.environ.clear()
    os.environ.update(CHILD_ENV)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too large a write raises OSError(EFBIG)
    libc.mallopt(M_ARENA_MAX, 2)  # as MALLOC_ARENA_MAX, which glibc read before the fork
    os._exit(_exec_main(source, path, args))


def _exec_main(source: str, path: str, args: list[str]) -> int:
    """Run `source` like `python main.py args...` would and return the exit status."""
    import atexit
    import builtins
    import io
    import types

    def stream(fd: int, mode: str, errors: str, line: bool) -> io.TextIOWrapper:
        raw = open(fd, mode + "b", buffering=0 if line else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, "utf-8", errors, line_buffering=line, write_through=line)

    sys.stdin = sys.__stdin__ = stream(0, "r", "strict", False)
    sys.stdout = sys.__stdout__ = stream(1, "w", "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace", True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    atexit._clear()
    code = 0
    try:
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # hide this frame
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, MemoryError):
            os.write(3, b"M")
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # join non-daemon threads, as interpreter exit does
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            code = code or 120  # what CPython returns when flushing stdout fails
    return code


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
