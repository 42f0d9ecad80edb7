"""Per-thread OpenMP thread counts for the engine thread.

`torch.set_num_threads` changes the count for the whole process (the learner too). The
OpenMP runtime also keeps a count per calling thread; setting that one from the engine
thread lets the engine decode small batches on one core while the rest of the process
keeps its threads. Why one core: when a process has OpenMP thread pools on more than one
thread (the main thread's, the engine's) and more pool threads than CPUs, GNU OpenMP
stops spin-waiting, and every parallel region then pays a futex wake-up (~50 us on the
machines measured). A decode step of a small batch runs hundreds of short regions, so
there one thread is faster than two; large batches still gain from two.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch uses, found among this process's mapped libraries."""
    maps = Path("/proc/self/maps")
    if not maps.is_file() or "OpenMP" not in torch.__config__.parallel_info():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if any(Path(path).name.startswith(name) for name in _RUNTIMES):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
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
