"""Memory bounded per run, not per process: a memory cgroup per run (v2 where delegated, the
v1 memory controller where that is what the kernel offers), else rlimits whose product fits.

`server_cgroup` runs in your process (outside the sandbox root, where /sys is): it makes an
empty cgroup for one server, which bubblewrap binds at CGROUP_MOUNT; the server's supervisors
make `run-<slot>` in it per concurrent run (`RunCgroup`). Runs in the server from a staged
copy as well: standard library only.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil

from .wire import CGROUP_MOUNT

_serial = itertools.count()


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of this process's mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            found.append((fields[4].encode().decode("unicode_escape"), tail[0], tail[-1]))
    return found


def server_cgroup(notes: list[str]) -> tuple[str, int] | None:
    """A fresh cgroup dir for one server, and its version (2 or 1); None (with a note) where
    this process cannot make one with the memory controller."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    name = f"masenvs-sandbox-{os.getpid()}-{next(_serial)}"
    reasons = []
    for version in (2, 1):
        try:
            if version == 2:
                own = next(path for hier, ctl, path in lines if hier == "0" and ctl == "")
                mount = next(m for m, fs, _ in _mounts() if fs == "cgroup2")
            else:
                own = next(p for _, ctl, p in lines if "memory" in ctl.split(","))
                mount = next(
                    m for m, fs, o in _mounts() if fs == "cgroup" and "memory" in o.split(",")
                )
        except StopIteration:
            reasons.append(f"no cgroup v{version} memory controller mounted")
            continue
        parent = os.path.join(mount, own.lstrip("/"))
        path = os.path.join(parent, name)
        _remove_orphans(parent)
        try:
            if version == 2:
                with open(os.path.join(parent, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        raise OSError("memory is not delegated to our cgroup v2")
            os.mkdir(path, 0o755)
            if version == 2:  # our runs' cgroups get the memory controller
                with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            reasons.append(f"cgroup v{version}: {exc}")
            continue
        return path, version
    notes.append("no memory cgroup for runs (" + "; ".join(reasons) + ")")
    return None


def _remove_orphans(parent: str) -> None:
    """Remove the cgroups of servers whose process died without removing them."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            parts = entry.name.split("-")
            ours = entry.name.startswith("masenvs-sandbox-") and len(parts) == 4
            if ours and parts[2].isdigit() and not os.path.exists(f"/proc/{parts[2]}"):
                remove_server_cgroup(entry.path)


def remove_server_cgroup(path: str) -> None:
    """Remove a server's cgroup and its runs' (once their processes are gone)."""
    if not os.path.isdir(path):
        return
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    if os.path.isdir(path):  # still busy: leave it, as the kernel would not remove it
        shutil.rmtree(path, ignore_errors=True)


class RunCgroup:
    """The memory cgroup of one concurrent run (slot): set its limit, let init join, then
    tell whether the kernel killed a process of it for memory. The cgroup stays for the
    next run of the slot (its counters are read before and after)."""

    def __init__(self, version: int, slot: int, memory_mb: int) -> None:
        self.version = version
        self.path = f"{CGROUP_MOUNT}/run-{slot}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path, 0o755)
        # Read and written through a descriptor: the run's init covers CGROUP_MOUNT in the
        # mount namespace it shares with its supervisor.
        self.dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        limit = str(memory_mb << 20)
        if version == 2:
            if self._read("memory.max").strip() != limit:
                self._write("memory.max", limit)
                self._write("memory.swap.max", "0", optional=True)
                self._write("memory.oom.group", "1", optional=True)
        elif self._read("memory.limit_in_bytes").strip() != limit:
            # memsw (memory + swap) may never be below memory: raising, it goes first.
            self._write("memory.memsw.limit_in_bytes", limit, optional=True)
            self._write("memory.limit_in_bytes", limit)
            self._write("memory.memsw.limit_in_bytes", limit, optional=True)
        self.kills_before = self.oom_kills()
        # Opened now, written by the run's init ("0": the writer) before it starts anything.
        # v1's `tasks` moves the one thread that writes (init has no other), which spares
        # the kernel the global lock of moving a whole thread group.
        procs = "cgroup.procs" if version == 2 else "tasks"
        self.procs_fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def _read(self, name: str) -> str:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:
            return ""
        try:
            return os.read(fd, 4096).decode()
        finally:
            os.close(fd)

    def _write(self, name: str, value: str, optional: bool = False) -> None:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError:
            if not optional:
                raise

    def oom_kills(self) -> int:
        """How many processes of this cgroup the kernel killed for memory, ever."""
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def over_budget(self) -> bool:
        """The kernel killed a process of this run for memory; closes the cgroup."""
        try:
            return self.oom_kills() > self.kills_before
        finally:
            os.close(self.dir_fd)


def join(procs_fd: int) -> None:
    """(the run's init) Move this process into its run's cgroup; its children follow."""
    os.write(procs_fd, b"0")
    os.close(procs_fd)


def processes_for(memory_mb: int, max_processes: int) -> tuple[int, int]:
    """Without a cgroup: (RLIMIT_AS in MB, RLIMIT_NPROC) whose product fits `memory_mb`,
    giving each process at least 128 MB of address space (a run that imported numpy
    holds 106 MB of it)."""
    nproc = max(1, min(max_processes, memory_mb // 128))
    return memory_mb // nproc, nproc
