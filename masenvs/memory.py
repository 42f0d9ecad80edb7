"""The C allocator's settings for long runs that hold an engine and a learner in one process.

glibc's malloc raises its mmap threshold to the size of the largest block freed so far (up
to 32 MiB): after the first tensors of a few MiB are freed, every later tensor below that
size comes from the heap arenas instead of its own mapping. A training step allocates and
frees gigabytes of such tensors (activations, logits chunks, decode-step buffers), and each
thread that runs torch ops (the engine's, the learner's, the endpoint's) has an arena of its
own; what is freed in the middle of an arena stays resident. In the main job that was 3-5
GB of a 8 GB peak (docs/memory.md).

`tune_allocator` fixes the threshold at 256 KiB and the arenas at two: every block of 256
KiB or more (activations, attention scores, logits chunks, KV blocks) gets a mapping of its
own and goes back to the system when freed. The price is a page fault per 4 KiB each time
such a block is allocated again: a 1 MiB threshold keeps the update's ~0.9 MiB hidden-size
activations in the heap and saves ~30% of the update's CPU time, but the main job then
peaked at 3.55 GB instead of under 3 (docs/memory.md has the measurements). What the heap
keeps after a phase goes back with `release_free_memory`, which the trainer calls after
each rollout and each update.

jemalloc does better than both: freed blocks are reused without a fault and go back to the
system a second later (fast's update speed at lean's peak). `masenvs train` therefore restarts
itself with libjemalloc preloaded wherever the library is installed (`MASENVS_MALLOC=auto`,
the default; `restart_with_jemalloc`), and tunes glibc as above where it is not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 * 1024  # bytes: blocks this large get their own mapping
FAST_MMAP_THRESHOLD = 1024 * 1024  # MASENVS_MALLOC=fast: hidden-size activations stay in the heap
TRIM_THRESHOLD = 16 * 1024 * 1024  # free bytes at an arena's top before they go back
ARENA_MAX = 2

# MASENVS_MALLOC=jemalloc: freed pages go back after a second (dirty_decay_ms), by a
# background thread, and are reused without a fault in between (docs/memory.md).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
# `python -X masenvs_jemalloc=[+]LIBRARY ...`: the restarted command, which preloaded LIBRARY
# (and set MALLOC_CONF where the leading + is). In argv, which no environment can forge.
_MARKER = "masenvs_jemalloc"
_CONF_MARK = "+"
# Where masenvs kept the restart's state before issue 41; a parent could forge them.
_FORMER_VARIABLES = ("MASENVS_JEMALLOC_RESTARTED", "MASENVS_JEMALLOC_SET_CONF")
MODES = ("auto", "lean", "fast", "jemalloc", "default")

# Set by a user or a parent process: glibc read them at start-up, so they are left alone.
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold, trim threshold and arena count (see the module docstring).

    `MASENVS_MALLOC=fast` sets a 1 MiB threshold instead of 256 KiB: ~30% less CPU time per
    update for ~0.5 GB more peak (docs/memory.md). Does nothing (returns False) off glibc,
    with jemalloc loaded (see `restart_with_jemalloc`), with `MASENVS_MALLOC=default`, or when
    the process was started with one of glibc's MALLOC_* tunables set. Any other value of
    MASENVS_MALLOC is an error.
    """
    mode = malloc_mode()
    if jemalloc_loaded() and mode in ("auto", "jemalloc"):
        return False
    if mode == "jemalloc":
        log.warning(
            "MASENVS_MALLOC=jemalloc, but jemalloc is not loaded: the masenvs command "
            "restarts itself with it; from Python, start with LD_PRELOAD=libjemalloc.so.2"
        )
        return False
    if mode == "default":
        return False
    if any(name in os.environ for name in _GLIBC_VARIABLES) or "GLIBC_TUNABLES" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    threshold = FAST_MMAP_THRESHOLD if mode == "fast" else MMAP_THRESHOLD
    ok = libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
    ok &= libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    ok &= libc.mallopt(M_ARENA_MAX, ARENA_MAX) == 1
    return bool(ok)


def malloc_mode() -> str:
    """MASENVS_MALLOC, checked: auto (also when unset), lean, fast, jemalloc or default."""
    mode = os.environ.get("MASENVS_MALLOC", "").lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"MASENVS_MALLOC={mode!r}: use auto (the default: jemalloc where libjemalloc is "
            "installed, else lean), lean (glibc with a 256 KiB mmap threshold), fast (1 MiB: "
            "quicker updates, ~0.5 GB more peak), jemalloc (fast's speed at lean's memory; an "
            "error without libjemalloc, e.g. apt-get install libjemalloc2) or default (glibc's "
            "own settings)"
        )
    return mode


def allocator() -> str:
    """The allocator this process runs with: 'jemalloc', or the glibc mode in effect."""
    if jemalloc_loaded():
        return "jemalloc"
    mode = malloc_mode()
    return "lean" if mode == "auto" else mode


def allocator_note() -> str:
    """The allocator, for the run's log; where auto mode found no jemalloc on Linux, how to
    get it (the main job's updates run ~1.5x faster per FLOP with it, docs/memory.md)."""
    name = allocator()
    if (
        name == "lean"
        and malloc_mode() == "auto"
        and sys.platform.startswith("linux")
        and ctypes.util.find_library("jemalloc") is None
    ):
        return (
            f"{name}; installing libjemalloc (apt-get install libjemalloc2) speeds updates up ~1.5x"
        )
    return name


def jemalloc_loaded() -> bool:
    """Whether jemalloc is mapped into this process (preloaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    # a mapped file's path is the sixth field; a library named libjemalloc-something is not it
    paths = (line.split(maxsplit=5)[5:] for line in maps.splitlines())
    return any(Path(path[0]).name.startswith("libjemalloc.so") for path in paths if path)


def restart_with_jemalloc(anywhere: bool = False) -> None:
    """Run this command again with jemalloc preloaded (the allocator must be in place before
    anything allocates): with MASENVS_MALLOC=jemalloc, or with auto (the default) where
    libjemalloc is installed and this process is the `masenvs` command (never a Python
    program that called its main(): that would restart the caller) or `anywhere` is set (a
    bench script that runs as `masenvs train` would). A no-op otherwise.

    The restarted process takes out of LD_PRELOAD exactly the library the restart appended
    (and MALLOC_CONF, when it was the restart's), so the programs it starts (vLLM, sandboxed
    tools, workflows) do not inherit the preload. That the process was restarted is told by
    an `-X` option in its own command line, never by an environment variable: what a parent
    process can set in the environment neither preloads anything nor turns jemalloc off.
    """
    for name in _FORMER_VARIABLES:  # older copies (a tool's or vLLM's env) would trust them
        os.environ.pop(name, None)
    mode = malloc_mode()
    restarted = _restart_marker()
    if jemalloc_loaded():
        if restarted is not None:
            _undo_restart(*restarted)
        return
    if mode not in ("auto", "jemalloc"):
        return
    library = ctypes.util.find_library("jemalloc")
    if mode == "auto" and (
        library is None
        or not sys.platform.startswith("linux")
        or not (anywhere or _is_masenvs_command())
    ):
        return
    if library is None:
        raise ValueError(
            "MASENVS_MALLOC=jemalloc: libjemalloc is not installed (Debian/Ubuntu: apt-get "
            "install libjemalloc2; macOS: brew install jemalloc); or use MASENVS_MALLOC=lean/fast"
        )
    if restarted is not None:
        _undo_restart(*restarted)
        message = f"MASENVS_MALLOC={mode}: {library} was preloaded but did not load"
        if mode == "jemalloc":
            raise ValueError(message)
        log.warning("%s; glibc's allocator is tuned instead (MASENVS_MALLOC=lean)", message)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), library]))
    marker = f"{_MARKER}={library}"
    if "MALLOC_CONF" not in env:
        env["MALLOC_CONF"], marker = JEMALLOC_CONF, f"{_MARKER}={_CONF_MARK}{library}"
    argv = [sys.orig_argv[0], "-X", marker, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def _restart_marker() -> tuple[str, bool] | None:
    """The library the restart preloaded and whether MALLOC_CONF is its own, from this
    process's `-X` option; None where this process is not a restart. The option is consumed,
    so Python children started with this interpreter's flags (multiprocessing) do not see it."""
    value = sys._xoptions.pop(_MARKER, None)
    if not isinstance(value, str) or not value.strip(_CONF_MARK):
        return None
    return value.removeprefix(_CONF_MARK), value.startswith(_CONF_MARK)


def _undo_restart(library: str, set_conf: bool) -> None:
    """Take the restart's own additions out of the environment (the library stays loaded):
    the library it appended to LD_PRELOAD, and the MALLOC_CONF it set."""
    preload = os.environ.get("LD_PRELOAD", "")
    entries = preload.replace(":", " ").split()
    if entries and entries[-1] == library:
        rest = preload.rstrip()[: -len(library)].rstrip(" :")
        if rest:
            os.environ["LD_PRELOAD"] = rest
        else:
            os.environ.pop("LD_PRELOAD", None)
    if set_conf and os.environ.get("MALLOC_CONF") == JEMALLOC_CONF:
        os.environ.pop("MALLOC_CONF")


def _is_masenvs_command() -> bool:
    """Whether this process was started as `masenvs ...` or `python -m masenvs ...`."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return argv0.name == "masenvs" or argv0.parts[-2:] == ("masenvs", "__main__.py")


def release_free_memory() -> None:
    """Give the free pages inside glibc's arenas back to the system (malloc_trim), e.g.
    between a rollout and an update, so one phase's leftovers do not add to the next's peak."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError off glibc)
    except (OSError, AttributeError):
        return None
    return libc
