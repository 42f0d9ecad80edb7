"""The parent side of the sandbox: the `Sandbox` API, which starts its server and asks it
for runs.

A warm "zygote" server (one per `Sandbox`) starts inside a bubblewrap root that holds only an
allow-list of host paths (masenvs/sandbox/layout.py), and forks a supervisor per run
(masenvs/sandbox/supervisor.py); the supervisor forks the program into fresh PID, mount, IPC,
UTS and network namespaces under a uid of its own (masenvs/sandbox/runsetup.py,
masenvs/sandbox/program.py), so starting a run costs a few forks instead of a new
interpreter. See docs/sandbox.md for the threat model.
"""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from .limits import CHILD_ENV, SandboxLimits, Verdict
from .staging import PACKAGE_DIR, SERVER_BOOT, bwrap_command
from .wire import (
    BIND_DIRS_MOUNT,
    BIND_NAME,
    MAX_BINDS,
    RUN_BIND_DIR,
    recv_msg,
    send_msg,
)

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
# Parent-side grace on top of the wall limit before the server itself is presumed stuck.
SERVER_GRACE_SECONDS = 30.0
# Packages a run may import beyond the standard library (with their dependencies), where
# installed: the math tool agent is told it may use sympy.
DEFAULT_PACKAGES = ("numpy", "sympy")
# Set to 1 to judge hidden tests in a sandbox that cannot hide them (see `check_judging`).
WEAK_SANDBOX_OPT_IN = "MASENVS_ALLOW_WEAK_SANDBOX"

# The name masenvs.sandbox always logged under (the package front door).
log = logging.getLogger("masenvs.sandbox")


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
    memory_cgroup: bool = False  # memory_mb bounds all of a run's processes together
    page_cache_pinned: bool = False  # no run can change which pages of shared files are cached
    files_in_ram: bool = False  # runs read a tmpfs copy: no dentry cache shared with the host
    task_data: tuple[str, ...] = ()  # paths of masenvs task data a run could read (judges refuse)

    @property
    def judging_safe(self) -> bool:
        """Hidden tests are out of a run's reach and runs cannot reach each other."""
        return (
            not self.task_data
            and self.allow_list
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
                "memory_cgroup",
                "page_cache_pinned",
                "files_in_ram",
            )
            if getattr(self, name)
        ]
        text = f"{self.mode}: {', '.join(on) or 'rlimits, scrubbed env, private dir only'}"
        return text + "".join(f"\n  note: {n}" for n in self.notes)


class SandboxError(OSError):
    """The sandbox itself failed (not the program it ran): a system-level error."""


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
        self._cgroup = ""  # the server's memory cgroup dir (removed when it stops)
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
        lacks = [f"no {', '.join(missing)}"] if missing else []
        if iso.task_data:
            lacks.append(f"task data of a masenvs copy visible at {', '.join(iso.task_data)}")
        reason = (
            f"the sandbox cannot {what} safely on this machine (mode {iso.mode!r}, "
            f"{'; '.join(lacks)}): a program could read the hidden tests or reach other "
            "runs and earn rewards without solving"
        )
        if os.environ.get(WEAK_SANDBOX_OPT_IN) == "1":
            warnings.warn(f"{reason}; going on because {WEAK_SANDBOX_OPT_IN}=1", stacklevel=2)
            return
        raise SandboxError(
            f"{reason}. Fix: move that copy out of the interpreter's and the allowed packages' "
            "trees (or drop the package that holds it); install bubblewrap (apt-get install bubblewrap) and run as root or "
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
        if self._cgroup and self._owner_pid == os.getpid():
            from .cgroup import remove_server_cgroup

            remove_server_cgroup(self._cgroup)
            self._cgroup = ""
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
                bwrap = bwrap_command(self.preload, self.packages, self.bind_dirs, notes)
            except Exception as exc:  # e.g. unreadable package metadata: say so, run weak
                notes.append(f"could not build the allow-list root ({exc!r})")
                bwrap = None
            if bwrap is not None:
                self._cgroup = bwrap[1].pop("cgroup_path", "")
                self._owner_pid = os.getpid()
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
        command = [sys.executable, "-I", "-c", SERVER_BOOT, PACKAGE_DIR]
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
        self._isolation = Isolation(
            **{**iso, "notes": tuple(iso["notes"]), "task_data": tuple(iso.get("task_data", ()))}
        )
        iso = self._isolation
        if self.namespaces and not iso.judging_safe:
            log.warning("masenvs sandbox is weak on this machine: %s", iso)
        elif self.namespaces and not (
            iso.memory_cgroup and (iso.page_cache_pinned or iso.files_in_ram)
        ):
            log.warning("masenvs sandbox: memory or page cache not isolated per run: %s", iso)
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
            isinstance(n, str) and BIND_NAME.fullmatch(n) and isinstance(p, str)
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
                send_msg(sock, request)
                reply = recv_msg(sock)
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
