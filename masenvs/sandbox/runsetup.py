"""How the server and each run are isolated: namespaces, mounts, capabilities, probes.

The zygote calls `setup_server` once to pick the strongest mode this machine allows; each
run's init mounts its private dirs with `mount_run_dirs`. Runs in the server from a staged
copy: standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from .limits import UID_BASE
from .wire import BIND_DIRS_MOUNT, CGROUP_MOUNT, RUN_BIND_DIR

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 0x4000, 0x40000, 1 << 21, 1 << 24
M_ARENA_MAX = -8
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
_MOUNT_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
    "nosymfollow": 256,
}

libc = ctypes.CDLL(None, use_errno=True)
if sys.platform.startswith("linux"):  # elsewhere the module imports; Sandbox refuses
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]


def check(rc: int, what: str) -> None:
    """Raise OSError with errno's message when a libc call returned non-zero."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2): move this process into new namespaces (CLONE_* flags)."""
    check(libc.unshare(flags), "unshare")


def mount(
    src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    """mount(2), with str arguments; None passes NULL."""
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    """prctl(2) with one argument."""
    check(libc.prctl(option, arg, 0, 0, 0), "prctl")


@dataclass
class ServerState:
    """State of the zygote: what isolation works, and the uid slots in use."""

    mode: str = "rlimits"  # "root", "userns" or "rlimits"; see client.Isolation
    uid_per_run: bool = False
    net_per_run: bool = False  # each run unshares its own network namespace
    allow_list: bool = False  # bubblewrap built our root from allow-listed paths only
    pidns: bool = False
    mountns: bool = False
    readonly: bool = False
    fresh_proc: bool = True  # a run's /proc shows its own namespace (else /proc is hidden)
    userns_per_run: bool = False  # userns mode: each program gets its own user namespace
    cap_last: int = 63
    cgroup: int = 0  # version of the memory cgroup each run gets (0: none, rlimits split)
    page_cache_pinned: bool = False  # every file a run can read is locked in memory
    files_in_ram: bool = False  # ... and served from a tmpfs copy (no shared dentry cache)
    task_data: list[str] = field(default_factory=list)  # visible paths of masenvs task data
    notes: list[str] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # supervisor pid -> uid slot
    pid: int = 0

    def isolation(self) -> dict:
        """What the parent's `Isolation` is built from (sent in the greeting)."""
        return {
            "mode": self.mode,
            "uid_per_run": self.uid_per_run,
            "network_namespace": self.net_per_run,
            "pid_namespace": self.pidns,
            "mount_namespace": self.mountns,
            "readonly_filesystem": self.readonly,
            "nproc_per_run": self.uid_per_run or self.userns_per_run,
            "notes": self.notes,
            "allow_list": self.allow_list and self.mountns,
            "ipc_namespace": self.pidns,  # unshared with the PID namespace, probed together
            "memory_cgroup": bool(self.cgroup),
            "page_cache_pinned": self.page_cache_pinned,
            "files_in_ram": self.files_in_ram,
            "task_data": self.task_data,
        }


def setup_server(
    srv: ServerState,
    namespaces: bool,
    preload: Sequence[str] = (),
    allow_list: bool = False,
    in_userns: bool = False,
    cgroup: int = 0,
) -> None:
    """Pick the strongest mode this machine allows and set up the server's namespaces.

    `allow_list`: bubblewrap started us in a root of allow-listed paths (as root of a user
    namespace of its making when `in_userns`)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/cap_last_cap") as f:
        srv.cap_last = int(f.read())
    if not namespaces:
        srv.notes.append("namespaces turned off by Sandbox(namespaces=False)")
    elif in_userns:
        srv.mode, srv.net_per_run = "userns", True
    elif os.geteuid() == 0:
        # Each run unshares a network namespace of its own: runs cannot reach each other's
        # abstract Unix sockets, and `network=True` simply keeps the host's.
        srv.mode, srv.uid_per_run, srv.net_per_run = "root", True, True
    else:
        try:
            _enter_user_namespace()
            srv.mode, srv.net_per_run = "userns", True
        except OSError as exc:
            srv.notes.append(f"no user namespace ({exc})")
    if srv.mode == "rlimits":
        srv.notes.append(
            "no namespaces: programs run as this user, so they can read and write what it can, "
            "reach the network, see /proc and signal its processes; only limits and the "
            "scrubbed environment apply"
        )
        return
    try:
        unshare(CLONE_NEWNS)
        # Private first, so nothing we mount below propagates back to the host.
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as exc:
        srv.notes.append(f"no mount namespace ({exc}); programs share the host's files and /tmp")
    else:
        if not allow_list:  # the weak fallback: the host's files minus a deny-list
            if srv.uid_per_run:
                _expose_interpreter(srv, preload)
            _hide_task_data(srv)
        srv.readonly = _remount_readonly(srv)
        srv.mountns = True
        srv.allow_list = allow_list
    srv.pidns = _probe_run_namespaces(srv)
    _probe_cgroup(srv, cgroup)
    if not srv.pidns:
        srv.net_per_run = False
        srv.notes.append("no PID namespace per run; runaway processes are found via /proc")
    if not srv.fresh_proc:
        srv.notes.append("cannot mount a fresh /proc per run; programs see an empty /proc")
    if not _probe_interpreter(srv):
        srv.notes.append(
            "the interpreter's files are not readable by the sandbox uid; imports of modules "
            "not preloaded will fail"
        )


def _probe_cgroup(srv: ServerState, version: int) -> None:
    """Check that a run's memory cgroup can be made and limited; say which bound holds."""
    from .cgroup import RunCgroup

    if version and srv.mode != "rlimits" and os.path.isdir(CGROUP_MOUNT):
        try:
            probe = RunCgroup(version, -1, 64)
            os.close(probe.procs_fd)
            os.close(probe.dir_fd)
            os.rmdir(probe.path)
            srv.cgroup = version
        except OSError as exc:
            srv.notes.append(f"cannot limit a run's cgroup ({exc})")
    if srv.cgroup:
        srv.notes.append(
            f"memory per run: a cgroup v{srv.cgroup} memory limit of memory_mb for all its "
            "processes together (and RLIMIT_AS of memory_mb per process)"
        )
    else:
        srv.notes.append(
            "memory per run: NO CGROUP; rlimits split memory_mb: RLIMIT_AS = memory_mb / n "
            "per process with at most n = max(1, min(max_processes, memory_mb // 128)) processes"
        )


def _enter_user_namespace() -> None:
    """Become root of a new user namespace that maps only our own uid and gid."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def drop_capabilities(cap_last: int) -> None:
    """Give up every capability for good (bounding set too, so exec cannot regain them)."""
    for cap in range(cap_last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def _others_can_enter(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return False


def _expose_interpreter(srv: ServerState, preload: Sequence[str] = ()) -> None:
    """Make the Python installation readable by the sandbox uid even if it lives in a
    private home (e.g. /root/.pyenv): cover the closed directory with a tmpfs that holds
    only read-only bind mounts of the interpreter's directories and of the preloaded
    packages (an editable install lives outside sys.path). This also hides the home."""
    needed = {
        os.path.realpath(p)
        for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, *sys.path)
        if p and os.path.isdir(p)
    }
    needed |= _package_dirs(preload)
    needed.add(os.path.dirname(os.path.realpath(sys.executable)))
    covers: dict[str, set[str]] = {}
    for path in needed:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not _others_can_enter(ancestor):
                covers.setdefault(ancestor, set()).add(path)
                break
    for closed, paths in covers.items():
        roots = sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in roots]
        try:
            mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
            for path, fd in zip(roots, fds, strict=True):
                os.makedirs(path, mode=0o755, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        finally:
            for fd in fds:
                os.close(fd)
        srv.notes.append(f"{closed} is hidden; only {', '.join(roots)} are visible, read-only")


def _hide_task_data(srv: ServerState) -> None:
    """Cover masenvs' task directory (hidden tests, golden modules and vectors) with an empty
    tmpfs, so a program cannot read the answers it is judged on. Judges send the harness
    sources they need over the control socket; nothing in a run imports from there."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("masenvs")
    except (ImportError, ValueError):
        return
    for root in (spec.submodule_search_locations or []) if spec else []:
        tasks = os.path.join(root, "tasks")
        if os.path.isdir(tasks):
            try:
                mount("tmpfs", tasks, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0555,size=16k")
            except OSError as exc:
                srv.notes.append(f"cannot hide {tasks} ({exc}); programs can read task data")


def _package_dirs(names: Sequence[str]) -> set[str]:
    """Where the top-level packages of `names` live, found without importing them."""
    import importlib.util

    dirs = set()
    for top in {name.split(".")[0] for name in names}:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        for path in spec.submodule_search_locations or [os.path.dirname(spec.origin or "")]:
            if path and os.path.isdir(path):
                dirs.add(os.path.realpath(path))
    return dirs


def _remount_readonly(srv: ServerState) -> bool:
    """Remount every mount of our private namespace read-only (the host is unaffected)."""
    failed = []
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = fields[4].encode().decode("unicode_escape")
        if target == CGROUP_MOUNT:
            continue  # the server's memory cgroup: runs cover it, supervisors write it
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _MOUNT_FLAGS.get(opt, 0)
        try:
            mount(None, target, None, flags)
        except OSError:
            failed.append(target)
    if failed:
        srv.notes.append(f"could not make read-only: {', '.join(failed)}")
    return set(failed) <= {"/proc"}  # each run mounts its own /proc anyway


def run_flags(srv: ServerState, network: bool) -> int:
    """The namespaces a supervisor unshares for one run."""
    if not srv.pidns:
        return 0
    # IPC: System V shared memory, semaphores and queues die with the run's namespace.
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNS if srv.mountns else 0)
    return flags | (CLONE_NEWNET if srv.net_per_run and not network else 0)


def _probe_run_namespaces(srv: ServerState) -> bool:
    """Check that a supervisor can create the per-run namespaces and mount /tmp and /proc,
    and (userns mode) that a program can get a user namespace of its own."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNS if srv.mountns else 0)
            unshare(flags | (CLONE_NEWNET if srv.net_per_run else 0))
            child = os.fork()
            if child == 0:
                ok = os.getpid() == 1
                if srv.mountns and mount_run_dirs(srv, UID_BASE - 1, 1):
                    os.write(w, b"P")
                if srv.mode == "userns" and os.fork() == 0:
                    with contextlib.suppress(BaseException):
                        own_user_namespace()
                        os.write(w, b"U")
                    os._exit(0)
                with contextlib.suppress(ChildProcessError):
                    os.wait()
                os._exit(0 if ok else 1)
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
        except BaseException:
            pass
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        report = f.read()
    srv.fresh_proc = b"P" in report or not srv.mountns
    # Since Linux 5.14 RLIMIT_NPROC counts per user namespace, so one per run isolates it.
    srv.userns_per_run = b"U" in report and _kernel_at_least(5, 14)
    return os.waitstatus_to_exitcode(status) == 0


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        return tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


def own_user_namespace() -> None:
    """(userns mode) Enter a user namespace of this run's own, mapping root to our root."""
    unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _probe_interpreter(srv: ServerState) -> bool:
    """As a sandbox uid, read a stdlib module that is not preloaded."""
    if not srv.uid_per_run:
        return True
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(UID_BASE - 1, UID_BASE - 1, UID_BASE - 1)
            os.setresuid(UID_BASE - 1, UID_BASE - 1, UID_BASE - 1)
            import importlib.util

            spec = importlib.util.find_spec("this")
            with open(spec.origin, "rb"):
                code = 0
        except BaseException:
            pass
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def mount_run_dirs(
    srv: ServerState, uid: int, file_mb: int, binds: dict[str, str] | None = None
) -> bool:
    """In a fresh mount namespace: a private tmpfs /tmp (and /dev/shm) owned by the program,
    a /proc of its PID namespace, and a read-only RUN_BIND_DIR holding this run's `binds`
    (name -> the file as the server sees it). Returns False if /proc could only be hidden."""
    owner = f"uid={uid},gid={uid}" if srv.uid_per_run else "uid=0,gid=0"
    opts = f"mode=0700,{owner},size={max(4 * file_mb, 8)}m,nr_inodes=4096"
    # Under the allow-list root, /tmp holds only allow-listed paths (an interpreter or venv
    # that lives under /tmp): they stay visible, read-only, over the run's private /tmp.
    kept = _allowed_under_tmp() if srv.allow_list else []
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for name, fd in kept:
        target = f"/tmp/{name}"
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    if os.path.isdir("/dev/pts"):  # one pseudo-terminal instance would be shared by all runs
        mount("tmpfs", "/dev/pts", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
    fresh_proc = True
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        # A user namespace may not mount proc over a partly masked one (containers);
        # an empty /proc is better than the host's, which shows other processes.
        mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k")
        fresh_proc = False
    # A tmpfs of the run's own holds its binds: it sees its own and nothing of another run's.
    # (Under bubblewrap RUN_BIND_DIR exists; on the host's files /run is covered instead.)
    top = RUN_BIND_DIR if os.path.isdir(RUN_BIND_DIR) else "/run"
    if os.path.isdir(top):
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        mount("tmpfs", top, "tmpfs", flags, "mode=0755,size=64k,nr_inodes=64")
        os.makedirs(RUN_BIND_DIR, 0o755, exist_ok=True)
        for name, source in (binds or {}).items():
            target = f"{RUN_BIND_DIR}/{name}"
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            mount(source, target, None, MS_BIND)
            mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        mount(None, top, None, MS_REMOUNT | MS_RDONLY | flags)
    for hidden in (BIND_DIRS_MOUNT, CGROUP_MOUNT):  # the bind dirs' other files, the cgroups
        if os.path.isdir(hidden):
            mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k")
    return fresh_proc


def _allowed_under_tmp() -> list[tuple[str, int]]:
    """The entries of the allow-list root's /tmp (name, O_PATH fd), opened before the run's
    own tmpfs covers them."""
    kept = []
    for name in os.listdir("/tmp"):
        kept.append((name, os.open(f"/tmp/{name}", os.O_PATH | os.O_NOFOLLOW)))
    return kept
