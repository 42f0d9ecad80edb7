"""Run model-written Python in a child process with limits (first, simple version)."""

from __future__ import annotations

import ctypes
import enum
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NOBODY = 65534


class Verdict(str, enum.Enum):
    """How a run ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run."""

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 65536
    network: bool = False


@dataclass(frozen=True)
class Job:
    """One program to run: source, stdin, command-line args and optional limits."""

    source: str
    stdin: str = ""
    args: Sequence[str] = ()
    limits: SandboxLimits | None = None


@dataclass
class RunResult:
    """Outcome of one run."""

    verdict: Verdict
    stdout: str
    stderr: str
    returncode: int | None
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.verdict == Verdict.OK


_RUNNER = r"""
import sys, traceback
src = open("main.py", encoding="utf-8").read()
sys.argv = ["main.py"] + sys.argv[1:]
try:
    code = compile(src, "main.py", "exec")
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
except MemoryError:
    traceback.print_exc()
    sys.stderr.flush()
    import os; os._exit(137)
"""


def _preexec(limits: SandboxLimits, as_root: bool) -> None:
    os.setsid()
    mem = limits.memory_mb * 1024 * 1024
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    for res, val in (
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, limits.max_file_mb * 1024 * 1024),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
        (resource.RLIMIT_NPROC, limits.max_processes),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (val, val))
    if as_root:
        if not limits.network:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


class Sandbox:
    """Runs untrusted Python source with limits; reusable and thread-safe."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.isolation = "uid nobody + netns" if os.geteuid() == 0 else "rlimits only"

    def run(
        self,
        source: str,
        stdin: str = "",
        args: Sequence[str] = (),
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        """Run one program and return its verdict and output."""
        lim = limits or self.limits
        as_root = os.geteuid() == 0
        workdir = tempfile.mkdtemp(prefix="masenvs-sb-")
        start = time.monotonic()
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            if as_root:
                os.chown(workdir, NOBODY, NOBODY)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _RUNNER, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir},
                preexec_fn=lambda: _preexec(lim, as_root),
            )
            verdict = None
            try:
                out, err = proc.communicate(stdin.encode(), timeout=lim.wall_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                verdict = Verdict.TIMEOUT
            rc = proc.returncode
            if verdict is None:
                if rc == -signal.SIGXCPU:
                    verdict = Verdict.TIMEOUT
                elif rc == 137 and b"MemoryError" in err:
                    verdict = Verdict.MEMORY
                elif len(out) > lim.max_output_bytes or len(err) > lim.max_output_bytes:
                    verdict = Verdict.OUTPUT_LIMIT
                else:
                    verdict = Verdict.OK if rc == 0 else Verdict.ERROR
            cap = lim.max_output_bytes
            return RunResult(
                verdict=verdict,
                stdout=out[:cap].decode("utf-8", "replace"),
                stderr=err[:cap].decode("utf-8", "replace"),
                returncode=rc,
                wall_seconds=time.monotonic() - start,
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def run_many(
        self,
        jobs: Sequence[tuple[str, str]] | Sequence[Job],
        max_workers: int | None = None,
    ) -> list[RunResult]:
        """Run many programs in parallel; results keep the order of `jobs`."""
        norm = [j if isinstance(j, Job) else Job(j[0], j[1]) for j in jobs]
        with ThreadPoolExecutor(max_workers or (os.cpu_count() or 2) * 2) as pool:
            return list(pool.map(lambda j: self.run(j.source, j.stdin, j.args, j.limits), norm))


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """Process-wide shared sandbox with default limits."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
        return _default


__all__ = [
    "Job",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "Verdict",
    "default_sandbox",
]
