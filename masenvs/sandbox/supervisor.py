"""The server (zygote) and its per-run supervisors.

The zygote sets up isolation once (runsetup.py), imports the preloaded modules, then forks a
supervisor for each run the parent asks for; a supervisor reads the request, starts the
run's init (program.py) in fresh namespaces, feeds and collects it, kills what is left and
replies. Started by `staging.SERVER_BOOT` from a staged copy: standard library only.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import sys
import time

from .cgroup import RunCgroup
from .limits import (
    UID_BASE,
    UID_SLOTS,
    SandboxLimits,
    count_processes_of,
    verdict_for,
)
from .pagecache import read_report, start_pinner
from .program import run_init
from .runsetup import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    ServerState,
    prctl,
    run_flags,
    setup_server,
    unshare,
)
from .seccomp import compiled_filter
from .wire import BIND_NAME, recv_msg, send_msg


def server_main(ctrl_fd: int, config_json: str) -> None:
    """Entry point of the zygote: set up isolation once, then fork a supervisor per run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = socket.socket(fileno=ctrl_fd)
    srv = _set_up_server(ctrl, json.loads(config_json))
    if srv is not None:
        _serve_runs(ctrl, srv)


def _set_up_server(ctrl: socket.socket, config: dict) -> ServerState | None:
    """Isolation, the preloaded modules and the page-cache pinner, once; the isolation (or the
    error) goes to the parent. None: the server is not to run."""
    if config.get("allow_list"):  # under bubblewrap: die with its (single-threaded) monitor
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            return None
    sys.path[:0] = config.get("path", [])  # the staged masenvs modules, under bubblewrap
    srv = ServerState(pid=os.getpid(), notes=list(config.get("notes", [])))
    try:
        setup_server(
            srv,
            config["namespaces"],
            config["preload"],
            config.get("allow_list", False),
            config.get("userns", False),
            config.get("cgroup", 0),
        )
    except Exception as exc:  # report, never crash silently
        ctrl.send(json.dumps({"error": f"setup failed: {exc!r}"}).encode())
        return None
    compiled_filter()  # built once here, not in every run
    # Pins what runs can read in the page cache while we import the preloaded modules.
    pinner = start_pinner(rewarm=not config.get("in_ram")) if srv.allow_list else None
    for name in config["preload"]:
        try:
            __import__(name)
        except Exception as exc:
            srv.notes.append(f"preload of {name!r} failed: {exc!r}")
    if pinner is not None:
        _note_pinned(srv, read_report(pinner[1]), config.get("in_ram", False))
    else:
        srv.notes.append(
            "page cache NOT pinned (no allow-list root): runs can tell which "
            "pages of shared files an earlier run loaded"
        )
    import gc

    gc.freeze()  # keep preloaded objects out of the children's collections (fewer COW faults)
    ctrl.send(json.dumps({"isolation": srv.isolation(), "pid": os.getpid()}).encode())
    return srv


def _serve_runs(ctrl: socket.socket, srv: ServerState) -> None:
    """Fork a supervisor for each run the parent asks for (its socket arrives on `ctrl`) and
    reap them as they exit, until the parent closes `ctrl`."""
    # SIGCHLD wakes the loop through this pipe, so finished supervisors are reaped at once.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([ctrl, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap_supervisors(srv)
        if ctrl not in readable:
            continue
        msg, anc, _, _ = ctrl.recvmsg(16, socket.CMSG_SPACE(4))
        if not msg:
            return  # the parent closed or died; our supervisors follow by PDEATHSIG
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        used = set(srv.slots.values())
        slot = next((i for i in range(UID_SLOTS) if i not in used), None)
        if not fds or slot is None:
            for fd in fds:
                os.close(fd)  # the parent sees EOF and reports it
            continue
        try:
            pid = os.fork()
        except OSError:  # out of processes or memory: this run fails, the server lives on
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            code = 0
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (ctrl.detach(), wake_r, wake_w, *fds[1:]):
                    os.close(fd)
                _supervise(srv, fds[0], UID_BASE + slot)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        srv.slots[pid] = slot


def _note_pinned(srv: ServerState, report: dict, in_ram: bool) -> None:
    srv.task_data = list(report.get("task_data", []))
    if srv.task_data:
        srv.notes.append(
            "task data of a masenvs copy is visible from a run: " + ", ".join(srv.task_data)
        )
    size = f"{report.get('files', 0)} files, {report.get('bytes', 0) / 2**20:.0f} MB"
    srv.files_in_ram = in_ram
    if in_ram:
        srv.notes.append(
            f"what runs see ({size}) is a copy in RAM (a tmpfs): no page of it to evict, "
            "no dentry of a missing name kept"
        )
    if report.get("locked"):
        srv.page_cache_pinned = True
        srv.notes.append(f"page cache: every file a run can read is locked in memory ({size})")
    elif not in_ram:
        srv.notes.append(
            f"page cache NOT pinned ({report.get('error')}): the {size} runs can read are "
            "loaded every few seconds instead, so a run can tell pages the host evicted since"
        )


def _reap_supervisors(srv: ServerState) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        srv.slots.pop(pid, None)


def _supervise(srv: ServerState, sock_fd: int, uid: int) -> None:
    """One run: read the request, start the program, feed and collect it, kill it, reply."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != srv.pid:
        return  # the server died before we set the signal
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the program come to us, not to the host init
    sock = socket.socket(fileno=sock_fd)
    req = recv_msg(sock)
    try:
        lim = SandboxLimits(**req["limits"])
        binds = req.get("binds", {})
        if not all(BIND_NAME.fullmatch(n) for n in binds):
            raise ValueError(f"bad bind names {list(binds)}")
        reply = _run_program(srv, req["source"], req["stdin"], req["args"], lim, uid, binds)
    except Exception as exc:
        reply = {"error": repr(exc)}
    send_msg(sock, reply)


def _run_program(
    srv: ServerState,
    source: str,
    stdin: str,
    args: list[str],
    lim: SandboxLimits,
    uid: int,
    binds: dict[str, str] | None = None,
) -> dict:
    workdir = _workdir(srv, uid)
    # RLIMIT_NPROC counts all processes of the program's user; where that user is shared
    # with this machine's (no uid or user namespace of its own), the limit comes on top.
    shared_nproc = 0
    if not srv.uid_per_run and not srv.userns_per_run:
        shared_nproc = count_processes_of(os.getuid())
    cgroup = RunCgroup(srv.cgroup, uid - UID_BASE, lim.memory_mb) if srv.cgroup else None
    if srv.pidns:
        unshare(run_flags(srv, lim.network))
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()  # init -> supervisor: the program's wait status
    rep_r, rep_w = os.pipe()  # program -> supervisor: "M" after an uncaught MemoryError
    start = time.monotonic()
    init_pid = os.fork()
    if init_pid == 0:
        try:
            for fd in (in_w, out_r, err_r, st_r, rep_r):
                os.close(fd)
            run_init(
                srv,
                source,
                args,
                lim,
                uid,
                workdir,
                (in_r, out_w, err_w, rep_w),
                st_w,
                shared_nproc,
                binds or {},
                cgroup.procs_fd if cgroup else None,
            )
        finally:
            os._exit(127)
    for fd in (in_r, out_w, err_w, st_w, rep_w):
        os.close(fd)
    if cgroup:
        os.close(cgroup.procs_fd)
    collected = _collect(
        init_pid, stdin.encode(), in_w, out_r, err_r, st_r, start + lim.wall_seconds, lim
    )
    _, _, usage = os.wait4(init_pid, 0)
    if not srv.pidns:
        _kill_descendants()
    os.set_blocking(rep_r, False)
    try:
        memory_error = os.read(rep_r, 1) == b"M"
    except BlockingIOError:
        memory_error = False
    for fd in (out_r, err_r, st_r, rep_r):
        os.close(fd)
    if not srv.mountns:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)  # fd-based, safe against symlink races
    over_budget = cgroup.over_budget() if cgroup else False
    return _reply(lim, collected, usage.ru_utime + usage.ru_stime, memory_error, over_budget)


def _workdir(srv: ServerState, uid: int) -> str:
    """The run's working dir: /tmp of its own mount namespace, else a fresh dir it owns."""
    if srv.mountns:
        return "/tmp"
    import tempfile

    workdir = tempfile.mkdtemp(prefix="masenvs-sandbox-")
    if srv.uid_per_run:
        os.chown(workdir, uid, uid)
    return workdir


def _reply(
    lim: SandboxLimits, collected: tuple, cpu: float, memory_error: bool, over_budget: bool
) -> dict:
    """The reply to the parent: the verdict and the program's output, cut at the limit."""
    out, err, status, killed, overflow = collected
    returncode = None if killed or overflow or status is None else os.waitstatus_to_exitcode(status)
    verdict = verdict_for(
        lim,
        returncode,
        killed=killed,
        overflow=overflow,
        cpu=cpu,
        memory_error=memory_error,
        stderr=err,
        over_budget=over_budget,
    )
    cap = lim.max_output_bytes
    return {
        "verdict": verdict.value,
        "stdout": out[:cap].decode("utf-8", "replace"),
        "stderr": err[:cap].decode("utf-8", "replace"),
        "returncode": returncode,
        "cpu_seconds": cpu,
    }


def _collect(
    init_pid: int,
    data: bytes,
    in_w: int,
    out_r: int,
    err_r: int,
    st_r: int,
    deadline: float,
    lim: SandboxLimits,
) -> tuple[bytes, bytes, int | None, bool, bool]:
    """Feed stdin and read output until the program ends, the deadline, or too much output."""
    cap = lim.max_output_bytes
    bufs = {out_r: bytearray(), err_r: bytearray(), st_r: bytearray()}
    poller = select.poll()
    for fd in bufs:
        poller.register(fd, select.POLLIN)
    if data:
        os.set_blocking(in_w, False)
        poller.register(in_w, select.POLLOUT)
    else:
        os.close(in_w)
    sent = 0
    killed = overflow = False
    open_fds = set(bufs)
    while st_r in open_fds and not overflow:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            killed = True
            break
        for fd, _ in poller.poll(remaining * 1000):
            if fd == in_w:
                try:
                    sent += os.write(in_w, data[sent : sent + 65536])
                    done = sent >= len(data)
                except (BrokenPipeError, BlockingIOError) as exc:
                    done = isinstance(exc, BrokenPipeError)
                if done:
                    poller.unregister(in_w)
                    os.close(in_w)
                    data = b""
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[fd] += chunk
            if fd != st_r and len(bufs[fd]) > cap:
                overflow = True
    if data:
        os.close(in_w)
    if killed or overflow:
        os.kill(init_pid, signal.SIGKILL)
    # The program and (in a PID namespace) everything it started are dead or dying now;
    # take what is left in the pipes without waiting on stragglers outside a namespace.
    for fd in open_fds:
        os.set_blocking(fd, False)
        try:
            while (chunk := os.read(fd, 65536)) and len(bufs[fd]) <= cap:
                bufs[fd] += chunk
        except BlockingIOError:
            pass
    status = int(bufs[st_r]) if bufs[st_r].strip() else None
    return bytes(bufs[out_r]), bytes(bufs[err_r]), status, killed, overflow


def _kill_descendants() -> None:
    """Without a PID namespace: SIGKILL every descendant (orphans come to us, as we are
    their subreaper) and reap them; rescan until none is left, as one may fork meanwhile."""
    me = os.getpid()
    while True:
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(name))
        todo, found = list(children.get(me, [])), 0
        while todo:
            pid = todo.pop()
            found += 1
            todo.extend(children.get(pid, []))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child left, dead or alive
        if not found:
            time.sleep(0.001)  # only zombies-to-be left; let them finish dying
