"""What a run may use and how its end is named: limits, verdicts, the rlimits behind them.

Shared by the parent and the server; the server runs a staged copy of this package with
the standard library only, so imports here are relative or standard library.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import resource
import signal
from dataclasses import dataclass

# Each concurrent run gets its own uid from this range when the sandbox runs as root, so
# RLIMIT_NPROC, signals and file ownership never cross between runs or reach real users.
UID_BASE = 2_000_000_000
UID_SLOTS = 65536
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
    memory_mb: int = 512  # of all the run's processes together (a cgroup), interpreter included
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


def set_rlimits(lim: SandboxLimits, shared_nproc: int, memory_cgroup: bool = True) -> None:
    """Put `lim` on this process (the program, just before it runs) as rlimits; a shared
    user's `shared_nproc` processes come on top of `max_processes`. Without a memory cgroup
    for the run, memory_mb is split between fewer processes (cgroup.processes_for)."""
    from .cgroup import processes_for

    mb = 1024 * 1024
    cpu = max(1, math.ceil(lim.cpu_seconds))
    memory_mb, nproc = lim.memory_mb, lim.max_processes
    if not memory_cgroup:
        memory_mb, nproc = processes_for(lim.memory_mb, lim.max_processes)
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory_mb * mb,) * 2),
        (resource.RLIMIT_FSIZE, (lim.max_file_mb * mb,) * 2),
        (resource.RLIMIT_NOFILE, (lim.max_open_files,) * 2),
        (resource.RLIMIT_NPROC, (nproc + shared_nproc,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
    ):
        resource.setrlimit(res, value)


def verdict_for(
    lim: SandboxLimits,
    returncode: int | None,
    *,
    killed: bool,
    overflow: bool,
    cpu: float,
    memory_error: bool,
    stderr: bytes,
    over_budget: bool = False,
) -> Verdict:
    """The verdict of a run that ended with `returncode` (None: the sandbox killed it);
    `over_budget`: the kernel killed a process of the run's memory cgroup."""
    signum = -returncode if returncode is not None and returncode < 0 else 0
    if overflow:
        return Verdict.OUTPUT_LIMIT
    if over_budget:
        return Verdict.MEMORY
    if killed or signum == signal.SIGXCPU or cpu > lim.cpu_seconds:
        return Verdict.TIMEOUT
    if memory_error or (
        signum in (signal.SIGSEGV, signal.SIGABRT, signal.SIGKILL)
        and (b"MemoryError" in stderr or b"Cannot allocate memory" in stderr)
    ):
        return Verdict.MEMORY
    if returncode == 0:
        return Verdict.OK
    return Verdict.ERROR


def count_processes_of(uid: int) -> int:
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
