"""OpenMP thread pools and the engine thread.

Every thread that runs a parallel torch op gets an OpenMP pool of its own, kept until the
thread ends. When a process has pools on several threads (the main thread's, the
engine's) and more pool threads than CPUs, GNU OpenMP stops spin-waiting, and every
parallel region then pays a futex wake-up (~50 us on the machines measured); a decode step
runs hundreds of short regions. Hence:

- `run_off_thread`: `EmbeddedBackend.from_spec` loads the model on a thread that ends, so
  in `masenvs serve` and `masenvs rollout` the engine's pool is the only one;
- `wakeups_are_costly`: the engine measures, on its own thread, whether the wake-ups are
  there (a learner on the main thread brings them back during training);
- `set_thread_local_threads`: if so, it decodes small batches on one thread. This count is
  the calling thread's only (`torch.set_num_threads` would change the learner's too).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def runtime_path() -> Path | None:
    """The file of the OpenMP runtime torch uses, found among this process's mapped
    libraries (native kernels link against it, so the process keeps one thread pool)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file() or "OpenMP" not in torch.__config__.parallel_info():
        return None
    for line in maps.read_text().splitlines():
        path = Path(line.split()[-1])
        if any(path.name.startswith(name) for name in _RUNTIMES) and path.is_file():
            return path
    return None


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    path = runtime_path()
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def set_thread_local_threads(count: int) -> bool:
    """Use `count` OpenMP threads for torch ops of the calling thread only; False where
    this cannot be done (no OpenMP runtime found), and nothing changes then."""
    runtime = _runtime()
    if runtime is None:
        return False
    torch.get_num_threads()  # torch sets a new thread's count on first use: let it first
    runtime.omp_set_num_threads(int(count))
    return True


def wakeups_are_costly(threads: int, repeats: int = 200) -> bool:
    """Whether a short parallel op on `threads` threads is clearly slower than on one,
    measured on the calling thread (about 10 ms): true where OpenMP threads sleep between
    regions (there it is 2-5x slower; where they spin, faster). The margin keeps a busy
    neighbour on a shared machine from tipping the answer."""
    x = torch.ones(1 << 17)

    def best_of(count: int) -> float:
        set_thread_local_threads(count)
        x.mul(2.0)  # let the pool start
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                x.mul(2.0)
            best = min(best, time.perf_counter() - start)
        return best

    if _runtime() is None:
        return False
    try:
        return best_of(threads) > 1.25 * best_of(1)
    finally:
        set_thread_local_threads(threads)


def run_off_thread(build: Callable[[], T]) -> T:
    """`build()` on a new thread that ends when it returns; its result, or its exception."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="masenvs-load", daemon=True)  # Ctrl-C exits
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
