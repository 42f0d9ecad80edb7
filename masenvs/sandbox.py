"""Run model-written Python in a child process with limits, isolation and explicit verdicts.

A warm "zygote" server (one per `Sandbox`) starts inside a bubblewrap root that holds only an
allow-list of host paths (masenvs/sandbox_layout.py), and forks a supervisor per run; the
supervisor forks the program into fresh PID, mount, IPC, UTS and network namespaces under a
uid of its own, so starting a run costs a few forks instead of a new interpreter. See
docs/sandbox.md for the threat model.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import enum
import json
import logging
import math
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

# Each concurrent run gets its own uid from this range when the sandbox runs as root, so
# RLIMIT_NPROC, signals and file ownership never cross between runs or reach real users.
UID_BASE = 2_000_000_000
UID_SLOTS = 65536
# Modules imported once in the zygote, so programs that use them start warm.
DEFAULT_PRELOAD = (
    "array",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "traceback",
    "types",
    "typing",
)
# The environment a program sees; nothing of the parent's leaks.
CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    # RLIMIT_AS counts reserved address space: keep glibc from reserving 64 MB per thread
    # and numeric libraries from starting a thread pool per core.
    "MALLOC_ARENA_MAX": "2",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# Parent-side grace on top of the wall limit before the server itself is presumed stuck.
SERVER_GRACE_SECONDS = 30.0
# Packages a run may import beyond the standard library (with their dependencies), where
# installed: the math tool agent is told it may use sympy.
DEFAULT_PACKAGES = ("numpy", "sympy")
# Where host files given to one run (`binds`, e.g. an auto-MAS gate's socket) appear in it.
RUN_BIND_DIR = "/run/masenvs"
BIND_DIRS_MOUNT = "/run/masenvs-host"  # the server's view of Sandbox.bind_dirs
MAX_BINDS = 8
_BIND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
# Set to 1 to judge hidden tests in a sandbox that cannot hide them (see `check_judging`).
WEAK_SANDBOX_OPT_IN = "MASENVS_ALLOW_WEAK_SANDBOX"

log = logging.getLogger(__name__)


class Verdict(str, enum.Enum):
    """How a run ended; compares equal to its string value."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run; vary with `dataclasses.replace`."""

    cpu_seconds: float = 5.0  # CPU time of the whole process tree
    wall_seconds: float = 10.0  # elapsed time; the whole tree is killed at the deadline
    memory_mb: int = 512  # address space per process (RLIMIT_AS), interpreter included
    max_processes: int = 32  # processes and threads alive at once (RLIMIT_NPROC)
    max_file_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    max_open_files: int = 64  # file descriptors per process (RLIMIT_NOFILE)
    max_output_bytes: int = 65536  # per stream; more is verdict "output_limit"
    network: bool = False  # True keeps the host network (not recommended)

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"SandboxLimits.{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.max_output_bytes, int) and self.max_output_bytes >= 0):
            raise ValueError(
                f"SandboxLimits.max_output_bytes must be an integer >= 0, got {self.max_output_bytes!r}"
            )
        if self.max_open_files < 8:
            raise ValueError(
                "SandboxLimits.max_open_files must be >= 8 (the interpreter needs some)"
            )


@dataclass(frozen=True)
class Job:
    """One program for `Sandbox.run_many`."""

    source: str
    stdin: str = ""
    args: Sequence[str] = ()
    limits: SandboxLimits | None = None
    binds: Mapping[str, str] | None = None  # name -> host path, see `Sandbox.run`


@dataclass
class RunResult:
    """Outcome of one run. `returncode` is None when the sandbox killed the program."""

    verdict: Verdict
    stdout: str
    stderr: str
    returncode: int | None
    wall_seconds: float
    cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict == Verdict.OK


@dataclass(frozen=True)
class Isolation:
    """What the sandbox could enforce on this machine (detected when the server starts)."""

    mode: str  # "root" (strongest), "userns" (non-root), "rlimits" (weak); see docs/sandbox.md
    uid_per_run: bool  # program runs as an unprivileged uid of its own
    network_namespace: bool  # no network unless SandboxLimits.network
    pid_namespace: bool  # program sees only its own processes; killing its init kills all
    mount_namespace: bool  # private /tmp (tmpfs, the working dir) and /proc per run
    readonly_filesystem: bool  # everything else is mounted read-only
    nproc_per_run: bool  # max_processes counts this run's processes only
    notes: tuple[str, ...] = ()
    allow_list: bool = False  # a run sees only the allow-list (no home, checkout, data)
    ipc_namespace: bool = False  # System V IPC of its own, gone with the run

    @property
    def judging_safe(self) -> bool:
        """Hidden tests are out of a run's reach and runs cannot reach each other."""
        return (
            self.allow_list
            and self.pid_namespace
            and self.ipc_namespace
            and self.network_namespace
            and self.mount_namespace
        )

    def __str__(self) -> str:
        on = [
            name
            for name in (
                "uid_per_run",
                "network_namespace",
                "pid_namespace",
                "mount_namespace",
                "readonly_filesystem",
                "nproc_per_run",
                "allow_list",
                "ipc_namespace",
            )
            if getattr(self, name)
        ]
        text = f"{self.mode}: {', '.join(on) or 'rlimits, scrubbed env, private dir only'}"
        return text + "".join(f"\n  note: {n}" for n in self.notes)


class SandboxError(OSError):
    """The sandbox itself failed (not the program it ran): a system-level error."""


# --------------------------------------------------------------------------------------
# Wire format between the parent and the server: 4-byte length + JSON.


def _send_msg(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, n))


# --------------------------------------------------------------------------------------
# Parent side.


class Sandbox:
    """Runs untrusted Python source under `limits`; reusable and safe to share across threads."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        namespaces: bool = True,
        packages: Sequence[str] = DEFAULT_PACKAGES,
        bind_dirs: Sequence[str] = (),
    ) -> None:
        """`preload`: modules imported once by the server so programs start warm.
        `packages`: installed packages a run may import (read-only, with their dependencies);
        the standard library and the preloaded modules' packages always are.
        `bind_dirs`: host dirs from which `run(binds=...)` may give a run single files (the
        server sees them, hidden; a run sees only the files it is given).
        `namespaces=False` skips all namespaces (mode "rlimits"), for machines where they fail."""
        self.limits = limits or SandboxLimits()
        self.preload = tuple(preload)
        self.packages = tuple(packages)
        self.bind_dirs = tuple(os.path.realpath(d) for d in bind_dirs)
        self.namespaces = namespaces
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None
        self._owner_pid = 0
        self._isolation: Isolation | None = None
        self.server_pid = 0  # the zygote's pid, once started

    # -- lifecycle

    @property
    def isolation(self) -> Isolation:
        """The isolation in force (starts the server if needed)."""
        with self._lock:
            self._ensure_server()
            assert self._isolation is not None
            return self._isolation

    def check_judging(self, what: str = "judge hidden tests") -> None:
        """Raise SandboxError unless runs here can neither read hidden tests nor reach each
        other; setting MASENVS_ALLOW_WEAK_SANDBOX=1 opts in anyway (with a warning)."""
        iso = self.isolation
        if iso.judging_safe:
            return
        missing = [
            name
            for name in (
                "allow_list",
                "pid_namespace",
                "ipc_namespace",
                "network_namespace",
                "mount_namespace",
            )
            if not getattr(iso, name)
        ]
        reason = (
            f"the sandbox cannot {what} safely on this machine (mode {iso.mode!r}, no "
            f"{', '.join(missing)}): a program could read the hidden tests or reach other "
            "runs and earn rewards without solving"
        )
        if os.environ.get(WEAK_SANDBOX_OPT_IN) == "1":
            warnings.warn(f"{reason}; going on because {WEAK_SANDBOX_OPT_IN}=1", stacklevel=2)
            return
        raise SandboxError(
            f"{reason}. Fix: install bubblewrap (apt-get install bubblewrap) and run as root or "
            "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "kernel.apparmor_restrict_unprivileged_userns=0); or opt in to weak judging with "
            f"{WEAK_SANDBOX_OPT_IN}=1. Notes: {'; '.join(iso.notes) or 'none'}"
        )

    def bind_path(self, name: str, host_path: str) -> str:
        """Where a run given `binds={name: host_path}` finds that file."""
        return f"{RUN_BIND_DIR}/{name}" if self.isolation.mount_namespace else host_path

    def _server_path(self, host_path: str) -> str:
        """Where the server sees `host_path`, which must lie in one of `bind_dirs`."""
        real = os.path.realpath(host_path)
        for i, top in enumerate(self.bind_dirs):
            if real.startswith(top + "/"):
                if self.isolation.allow_list:
                    return f"{BIND_DIRS_MOUNT}/{i}/{os.path.relpath(real, top)}"
                return real
        raise ValueError(
            f"Sandbox.run binds: {host_path} is not inside the sandbox's bind_dirs "
            f"{list(self.bind_dirs)}"
        )

    def close(self) -> None:
        """Stop the server; running programs are killed. The sandbox restarts on next use."""
        with self._lock:
            self._stop_server()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Plain try: at interpreter exit module globals such as `contextlib` may be gone.
        try:  # noqa: SIM105
            self._stop_server()
        except Exception:
            pass

    def _stop_server(self) -> None:
        if self._ctrl is not None and self._owner_pid == os.getpid():
            self._ctrl.close()  # EOF tells the server to exit; its supervisors follow it
            if self._server is not None:
                try:
                    self._server.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._server.kill()
                    self._server.wait()
        self._ctrl = self._server = None

    def _ensure_server(self) -> socket.socket:
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"masenvs.sandbox needs Linux (this is {sys.platform})")
        if self._ctrl is not None and self._owner_pid != os.getpid():
            # We are a forked copy of the process that started the server: start our own.
            self._ctrl = self._server = None
        if self._ctrl is not None and self._server is not None and self._server.poll() is None:
            return self._ctrl
        self._stop_server()
        notes: list[str] = []
        if self.namespaces:
            try:
                bwrap = _bwrap_command(self.preload, self.packages, self.bind_dirs, notes)
            except Exception as exc:  # e.g. unreadable package metadata: say so, run weak
                notes.append(f"could not build the allow-list root ({exc!r})")
                bwrap = None
            if bwrap is not None:
                try:
                    return self._start_server(*bwrap, notes)
                except SandboxError as exc:
                    notes.append(f"bubblewrap could not start the server ({exc})")
        if self.namespaces:
            notes.append(
                "NO ALLOW-LIST: runs see the host's files (read-only, minus masenvs' tasks "
                "folder): checkouts, .git, datasets and other copies of masenvs are readable; "
                "judges refuse to run (Sandbox.check_judging)"
            )
        command = [sys.executable, "-I", "-c", _BOOT, __file__]
        return self._start_server(command, {"allow_list": False}, notes)

    def _start_server(self, command: list[str], extra: dict, notes: list[str]) -> socket.socket:
        """Start `command + [fd, config]` as the server and read its greeting."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = json.dumps(
            {"preload": self.preload, "namespaces": self.namespaces, "notes": notes, **extra}
        )
        import tempfile

        with tempfile.TemporaryFile() as errors:  # what bubblewrap says if it cannot set up
            try:
                self._server = subprocess.Popen(
                    [*command, str(theirs.fileno()), config],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errors,
                    env=CHILD_ENV,
                    cwd="/",
                    start_new_session=True,  # Ctrl-C in a terminal goes to us, not the server
                )
            finally:
                theirs.close()
            ours.settimeout(60)
            try:
                hello = json.loads(ours.recv(1 << 16) or b"null")
            except (OSError, ValueError) as exc:
                hello = {"error": f"no greeting ({exc})"}
            if not isinstance(hello, dict) or "error" in hello or "isolation" not in hello:
                self._server.kill()
                self._server.wait()
                errors.seek(0)
                said = errors.read(2000).decode("utf-8", "replace").strip()
                reason = (
                    hello.get("error")
                    if isinstance(hello, dict)
                    else f"it exited with code {self._server.returncode}"
                )
                self._server = None
                ours.close()
                raise SandboxError(
                    f"the sandbox server failed to start: {reason}" + (f" ({said})" if said else "")
                )
        ours.settimeout(None)
        self._ctrl, self._owner_pid = ours, os.getpid()
        # The zygote itself (under bubblewrap, a child of the bwrap process `_server`).
        self.server_pid = int(hello.get("pid", self._server.pid))
        iso = hello["isolation"]
        self._isolation = Isolation(**{**iso, "notes": tuple(iso["notes"])})
        if self.namespaces and not self._isolation.judging_safe:
            log.warning("masenvs sandbox is weak on this machine: %s", self._isolation)
        return ours

    def _open_run(self) -> socket.socket:
        """A socket connected to a fresh supervisor process for one run."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                for attempt in (0, 1):
                    ctrl = self._ensure_server()
                    try:
                        fds = array.array("i", [theirs.fileno()])
                        ctrl.sendmsg([b"R"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                        break
                    except OSError:
                        if attempt:
                            raise
                        self._stop_server()  # the server died; start a new one once
        finally:
            theirs.close()
        return mine

    # -- runs

    def run(
        self,
        source: str,
        stdin: str = "",
        args: Sequence[str] = (),
        limits: SandboxLimits | None = None,
        binds: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run one program and return its verdict and (capped) output.

        `binds`: host files (e.g. a Unix socket) this run alone may open, each at
        `bind_path(name, path)` (RUN_BIND_DIR/name where runs have a mount namespace)."""
        if not isinstance(source, str) or not isinstance(stdin, str):
            raise TypeError("Sandbox.run needs source and stdin as str")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError("Sandbox.run needs args as a sequence of str")
        binds = dict(binds or {})
        if len(binds) > MAX_BINDS or not all(
            isinstance(n, str) and _BIND_NAME.fullmatch(n) and isinstance(p, str)
            for n, p in binds.items()
        ):
            raise ValueError(
                f"Sandbox.run binds: at most {MAX_BINDS} names of [A-Za-z0-9_.-] to host paths"
            )
        lim = limits or self.limits
        start = time.monotonic()
        sources = {name: self._server_path(path) for name, path in binds.items()}
        sock = self._open_run()
        with sock:
            sock.settimeout(lim.wall_seconds + SERVER_GRACE_SECONDS)
            request = {
                "source": source,
                "stdin": stdin,
                "args": list(args),
                "limits": asdict(lim),
                "binds": sources,
            }
            try:
                _send_msg(sock, request)
                reply = _recv_msg(sock)
            except (OSError, EOFError, ValueError) as exc:
                raise SandboxError(
                    f"the sandbox server stopped answering ({exc!r}); it restarts on the next run"
                ) from exc
        if "error" in reply:
            raise SandboxError(f"the sandbox could not run the program: {reply['error']}")
        return RunResult(
            verdict=Verdict(reply["verdict"]),
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            returncode=reply["returncode"],
            wall_seconds=time.monotonic() - start,
            cpu_seconds=reply["cpu_seconds"],
        )

    def run_many(
        self,
        jobs: Sequence[tuple[str, str]] | Sequence[Job],
        max_workers: int | None = None,
    ) -> list[RunResult]:
        """Run programs in parallel; results keep the order of `jobs`."""
        norm = [j if isinstance(j, Job) else Job(*j) for j in jobs]
        if not norm:
            return []
        workers = max_workers or min(len(norm), (os.cpu_count() or 2) * 2)
        with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
            return list(
                pool.map(lambda j: self.run(j.source, j.stdin, j.args, j.limits, j.binds), norm)
            )


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide shared sandbox with default limits."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
        return _default


def _bwrap_command(
    preload: Sequence[str], packages: Sequence[str], bind_dirs: Sequence[str], notes: list[str]
) -> tuple[list[str], dict] | None:
    """The server's command line inside a bubblewrap root of allow-listed paths, and its
    extra config; None (with a note) where bubblewrap is not installed.

    The server is root there (of a user namespace bubblewrap makes, when we are not root),
    so that it can still give each run its own namespaces and uid."""
    from masenvs import sandbox_layout as layout

    bwrap = layout.bwrap_path()
    if bwrap is None:
        notes.append("bubblewrap (bwrap) is not installed, so runs get no allow-list")
        return None
    userns = os.geteuid() != 0
    modules = layout.masenvs_modules(preload)
    needed = {*packages, *(name.split(".")[0] for name in preload)}
    needed |= layout.third_party_imports(modules.values())
    with open(__file__, encoding="utf-8") as f:
        stage = layout.stage(f.read(), modules)
    root = layout.build_layout(sorted(needed), stage)
    # Hidden from runs, which get single files of them (Sandbox.run's binds).
    root.hidden = [(path, f"{BIND_DIRS_MOUNT}/{i}") for i, path in enumerate(bind_dirs)]
    # Not --die-with-parent: the parent death signal follows the thread that started bwrap,
    # which may be a worker thread. The server exits when our socket closes, and dies with
    # bwrap (its own death signal, see _server_main).
    command = [bwrap, "--new-session", "--unshare-ipc", "--unshare-uts"]
    command += ["--unshare-cgroup-try"]
    if userns:
        command += ["--unshare-user", "--uid", "0", "--gid", "0"]
    command += ["--cap-add", "ALL", *root.bwrap_args(), "--chdir", "/", "--"]
    command += [sys.executable, "-I", "-c", _BOOT, f"{layout.STAGE_MOUNT}/server.py"]
    paths = [f"{layout.STAGE_MOUNT}/lib"] if modules else []
    return command, {"allow_list": True, "userns": userns, "path": paths}


# --------------------------------------------------------------------------------------
# Server side: everything below runs in the zygote process and its forks.

_BOOT = (
    "import importlib.util as u,sys;"
    "s=u.spec_from_file_location('_masenvs_sandbox_server',sys.argv[1]);"
    "m=u.module_from_spec(s);sys.modules[s.name]=m;s.loader.exec_module(m);"
    "m._server_main(int(sys.argv[2]),sys.argv[3])"
)

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

_libc = ctypes.CDLL(None, use_errno=True)
if sys.platform.startswith("linux"):  # elsewhere the module imports; Sandbox refuses
    _libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    _libc.prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _mount(
    src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl")


@dataclass
class _Server:
    """State of the zygote: what isolation works, and the uid slots in use."""

    mode: str = "rlimits"  # "root", "userns" or "rlimits"; see Isolation
    uid_per_run: bool = False
    net_per_run: bool = False  # each run unshares its own network namespace
    allow_list: bool = False  # bubblewrap built our root from allow-listed paths only
    pidns: bool = False
    mountns: bool = False
    readonly: bool = False
    fresh_proc: bool = True  # a run's /proc shows its own namespace (else /proc is hidden)
    userns_per_run: bool = False  # userns mode: each program gets its own user namespace
    cap_last: int = 63
    notes: list[str] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # supervisor pid -> uid slot
    pid: int = 0

    def isolation(self) -> dict:
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
        }


def _server_main(ctrl_fd: int, config_json: str) -> None:
    """Entry point of the zygote: set up isolation once, then fork a supervisor per run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = socket.socket(fileno=ctrl_fd)
    config = json.loads(config_json)
    if config.get("allow_list"):  # under bubblewrap: die with its (single-threaded) monitor
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            return
    sys.path[:0] = config.get("path", [])  # the staged masenvs modules, under bubblewrap
    srv = _Server(pid=os.getpid(), notes=list(config.get("notes", [])))
    try:
        _setup_server(
            srv,
            config["namespaces"],
            config["preload"],
            config.get("allow_list", False),
            config.get("userns", False),
        )
    except Exception as exc:  # report, never crash silently
        ctrl.send(json.dumps({"error": f"setup failed: {exc!r}"}).encode())
        return
    for name in config["preload"]:
        try:
            __import__(name)
        except Exception as exc:
            srv.notes.append(f"preload of {name!r} failed: {exc!r}")
    import gc

    gc.freeze()  # keep preloaded objects out of the children's collections (fewer COW faults)
    ctrl.send(json.dumps({"isolation": srv.isolation(), "pid": os.getpid()}).encode())
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


def _reap_supervisors(srv: _Server) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        srv.slots.pop(pid, None)


def _setup_server(
    srv: _Server,
    namespaces: bool,
    preload: Sequence[str] = (),
    allow_list: bool = False,
    in_userns: bool = False,
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
        _unshare(CLONE_NEWNS)
        # Private first, so nothing we mount below propagates back to the host.
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
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


def _enter_user_namespace() -> None:
    """Become root of a new user namespace that maps only our own uid and gid."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _drop_capabilities(cap_last: int) -> None:
    """Give up every capability for good (bounding set too, so exec cannot regain them)."""
    for cap in range(cap_last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def _others_can_enter(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return False


def _expose_interpreter(srv: _Server, preload: Sequence[str] = ()) -> None:
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
            _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
            for path, fd in zip(roots, fds, strict=True):
                os.makedirs(path, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        finally:
            for fd in fds:
                os.close(fd)
        srv.notes.append(f"{closed} is hidden; only {', '.join(roots)} are visible, read-only")


def _hide_task_data(srv: _Server) -> None:
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
                _mount("tmpfs", tasks, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0555,size=16k")
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


def _remount_readonly(srv: _Server) -> bool:
    """Remount every mount of our private namespace read-only (the host is unaffected)."""
    failed = []
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = fields[4].encode().decode("unicode_escape")
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _MOUNT_FLAGS.get(opt, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            failed.append(target)
    if failed:
        srv.notes.append(f"could not make read-only: {', '.join(failed)}")
    return set(failed) <= {"/proc"}  # each run mounts its own /proc anyway


def _run_flags(srv: _Server, network: bool) -> int:
    """The namespaces a supervisor unshares for one run."""
    if not srv.pidns:
        return 0
    # IPC: System V shared memory, semaphores and queues die with the run's namespace.
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNS if srv.mountns else 0)
    return flags | (CLONE_NEWNET if srv.net_per_run and not network else 0)


def _probe_run_namespaces(srv: _Server) -> bool:
    """Check that a supervisor can create the per-run namespaces and mount /tmp and /proc,
    and (userns mode) that a program can get a user namespace of its own."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNS if srv.mountns else 0)
            _unshare(flags | (CLONE_NEWNET if srv.net_per_run else 0))
            child = os.fork()
            if child == 0:
                ok = os.getpid() == 1
                if srv.mountns and _mount_run_dirs(srv, UID_BASE - 1, 1):
                    os.write(w, b"P")
                if srv.mode == "userns" and os.fork() == 0:
                    with contextlib.suppress(BaseException):
                        _own_user_namespace()
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


# Syscalls by which two concurrent runs could still signal each other through the files
# they share read-only: file locks (set: pretend success, so no lock is ever held across
# runs; test: refused) and inotify (refused). Per architecture: (audit arch, flock, fcntl,
# inotify syscalls, an x32-style bit that must not be set).
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 73, 72, (253, 294), 0x40000000),
    "aarch64": (0xC00000B7, 32, 25, (26,), 0),
}
F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 5, 6, 7, 36, 37, 38


def _filter_covert_syscalls() -> None:
    """Install a seccomp filter (inherited by every child) against the lock and inotify
    covert channels; syscalls of another architecture's ABI are refused outright."""
    import errno
    import platform

    spec = _SECCOMP_ARCH.get(platform.machine())
    if spec is None:
        return
    arch, flock, fcntl, inotify, x32 = spec
    allow, fake_ok, deny = 0x7FFF0000, 0x00050000, 0x00050000 | errno.EPERM
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    # (code, true target, false target, k); targets are labels or None (next instruction).
    prog: list[tuple[int, str | None, str | None, int]] = [
        (ld, None, None, 4),  # seccomp_data.arch
        (jeq, None, "deny", arch),
        (ld, None, None, 0),  # seccomp_data.nr
    ]
    if x32:
        prog.append((jge, "deny", None, x32))
    prog.append((jeq, "fake_ok", None, flock))
    prog += [(jeq, "deny", None, nr) for nr in inotify]
    prog += [(jeq, "fcntl", None, fcntl), (ret, None, None, allow)]
    labels = {"fcntl": len(prog)}
    prog.append((ld, None, None, 24))  # low half of args[1], the fcntl command
    prog += [(jeq, "deny", None, cmd) for cmd in (F_GETLK, F_OFD_GETLK)]
    prog += [(jeq, "fake_ok", None, cmd) for cmd in (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW)]
    prog.append((ret, None, None, allow))
    labels["fake_ok"] = len(prog)
    prog.append((ret, None, None, fake_ok))
    labels["deny"] = len(prog)
    prog.append((ret, None, None, deny))

    class Filter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    def jump(i: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - i - 1

    code = (Filter * len(prog))(
        *(Filter(c, jump(i, t), jump(i, f), k) for i, (c, t, f, k) in enumerate(prog))
    )
    fprog = Program(len(prog), code)
    # prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog): no_new_privs is already set.
    _check(_libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0), "seccomp")


def _own_user_namespace() -> None:
    """(userns mode) Enter a user namespace of this run's own, mapping root to our root."""
    _unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _count_processes_of(uid: int) -> int:
    """How many processes (threads included, as RLIMIT_NPROC counts) `uid` has now."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{name}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


def _probe_interpreter(srv: _Server) -> bool:
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


def _mount_run_dirs(
    srv: _Server, uid: int, file_mb: int, binds: dict[str, str] | None = None
) -> bool:
    """In a fresh mount namespace: a private tmpfs /tmp (and /dev/shm) owned by the program,
    a /proc of its PID namespace, and a read-only RUN_BIND_DIR holding this run's `binds`
    (name -> the file as the server sees it). Returns False if /proc could only be hidden."""
    owner = f"uid={uid},gid={uid}" if srv.uid_per_run else "uid=0,gid=0"
    opts = f"mode=0700,{owner},size={max(4 * file_mb, 8)}m,nr_inodes=4096"
    # Under the allow-list root, /tmp holds only allow-listed paths (an interpreter or venv
    # that lives under /tmp): they stay visible, read-only, over the run's private /tmp.
    kept = _allowed_under_tmp() if srv.allow_list else []
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for name, fd in kept:
        target = f"/tmp/{name}"
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    if os.path.isdir("/dev/pts"):  # one pseudo-terminal instance would be shared by all runs
        _mount(
            "tmpfs", "/dev/pts", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k"
        )
    fresh_proc = True
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        # A user namespace may not mount proc over a partly masked one (containers);
        # an empty /proc is better than the host's, which shows other processes.
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k")
        fresh_proc = False
    # A tmpfs of the run's own holds its binds: it sees its own and nothing of another run's.
    # (Under bubblewrap RUN_BIND_DIR exists; on the host's files /run is covered instead.)
    top = RUN_BIND_DIR if os.path.isdir(RUN_BIND_DIR) else "/run"
    if os.path.isdir(top):
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        _mount("tmpfs", top, "tmpfs", flags, "mode=0755,size=64k,nr_inodes=64")
        os.makedirs(RUN_BIND_DIR, 0o755, exist_ok=True)
        for name, source in (binds or {}).items():
            target = f"{RUN_BIND_DIR}/{name}"
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(source, target, None, MS_BIND)
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        _mount(None, top, None, MS_REMOUNT | MS_RDONLY | flags)
    if os.path.isdir(BIND_DIRS_MOUNT):  # every other file of the bind dirs stays unseen
        _mount("tmpfs", BIND_DIRS_MOUNT, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k")
    return fresh_proc


def _allowed_under_tmp() -> list[tuple[str, int]]:
    """The entries of the allow-list root's /tmp (name, O_PATH fd), opened before the run's
    own tmpfs covers them."""
    kept = []
    for name in os.listdir("/tmp"):
        kept.append((name, os.open(f"/tmp/{name}", os.O_PATH | os.O_NOFOLLOW)))
    return kept


def _supervise(srv: _Server, sock_fd: int, uid: int) -> None:
    """One run: read the request, start the program, feed and collect it, kill it, reply."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != srv.pid:
        return  # the server died before we set the signal
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the program come to us, not to the host init
    sock = socket.socket(fileno=sock_fd)
    req = _recv_msg(sock)
    try:
        lim = SandboxLimits(**req["limits"])
        binds = req.get("binds", {})
        if not all(_BIND_NAME.fullmatch(n) for n in binds):
            raise ValueError(f"bad bind names {list(binds)}")
        reply = _run_program(srv, req["source"], req["stdin"], req["args"], lim, uid, binds)
    except Exception as exc:
        reply = {"error": repr(exc)}
    _send_msg(sock, reply)


def _run_program(
    srv: _Server,
    source: str,
    stdin: str,
    args: list[str],
    lim: SandboxLimits,
    uid: int,
    binds: dict[str, str] | None = None,
) -> dict:
    workdir = "/tmp"
    if not srv.mountns:
        import tempfile

        workdir = tempfile.mkdtemp(prefix="masenvs-sandbox-")
        if srv.uid_per_run:
            os.chown(workdir, uid, uid)
    # RLIMIT_NPROC counts all processes of the program's user; where that user is shared
    # with this machine's (no uid or user namespace of its own), the limit comes on top.
    shared_nproc = 0
    if not srv.uid_per_run and not srv.userns_per_run:
        shared_nproc = _count_processes_of(os.getuid())
    if srv.pidns:
        _unshare(_run_flags(srv, lim.network))
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
            _init(
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
            )
        finally:
            os._exit(127)
    for fd in (in_r, out_w, err_w, st_w, rep_w):
        os.close(fd)
    collected = _collect(
        init_pid, stdin.encode(), in_w, out_r, err_r, st_r, start + lim.wall_seconds, lim
    )
    out, err, status, killed, overflow = collected
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
    cpu = usage.ru_utime + usage.ru_stime
    returncode = None if killed or overflow or status is None else os.waitstatus_to_exitcode(status)
    signum = -returncode if returncode is not None and returncode < 0 else 0
    if overflow:
        verdict = Verdict.OUTPUT_LIMIT
    elif killed or signum == signal.SIGXCPU or cpu > lim.cpu_seconds:
        verdict = Verdict.TIMEOUT
    elif memory_error or (
        signum in (signal.SIGSEGV, signal.SIGABRT, signal.SIGKILL)
        and (b"MemoryError" in err or b"Cannot allocate memory" in err)
    ):
        verdict = Verdict.MEMORY
    elif returncode == 0:
        verdict = Verdict.OK
    else:
        verdict = Verdict.ERROR
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


def _init(
    srv: _Server,
    source: str,
    args: list[str],
    lim: SandboxLimits,
    uid: int,
    workdir: str,
    stdio: tuple[int, int, int, int],
    st_w: int,
    shared_nproc: int,
    binds: dict[str, str],
) -> None:
    """PID 1 of the run's namespace: mount its private dirs, start the program, report how
    it ended, exit. Exiting makes the kernel kill everything else left in the namespace."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor died: take the namespace down
    try:
        if srv.mountns:
            _mount_run_dirs(srv, uid, lim.max_file_mb, binds)
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
    srv: _Server,
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
            _own_user_namespace()
        _drop_capabilities(srv.cap_last)  # root of a user namespace, but powerless
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if srv.allow_list:
        _filter_covert_syscalls()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.chdir(workdir)
    path = os.path.join(workdir, "main.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(source)
    mb = 1024 * 1024
    cpu = max(1, math.ceil(lim.cpu_seconds))
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (lim.memory_mb * mb,) * 2),
        (resource.RLIMIT_FSIZE, (lim.max_file_mb * mb,) * 2),
        (resource.RLIMIT_NOFILE, (lim.max_open_files,) * 2),
        (resource.RLIMIT_NPROC, (lim.max_processes + shared_nproc,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
    ):
        resource.setrlimit(res, value)
    os.environ.clear()
    os.environ.update(CHILD_ENV)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too large a write raises OSError(EFBIG)
    _libc.mallopt(M_ARENA_MAX, 2)  # as MALLOC_ARENA_MAX, which glibc read before the fork
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
