"""The seccomp filter every program runs under where runs have the allow-list root.

Runs in the server from a staged copy: standard library only.
"""

from __future__ import annotations

import ctypes
import functools

from .runsetup import check, libc

# Syscall numbers per architecture (audit arch, an x32-style bit that must not be set).
_SECCOMP_ARCH = {
    "x86_64": (
        0xC000003E,
        0x40000000,
        {
            "flock": 73,
            "fcntl": 72,
            "inotify_init": 253,
            "inotify_init1": 294,
            "mincore": 27,
            "madvise": 28,
            "readahead": 187,
            "fadvise64": 221,
            "preadv2": 327,
            "pwritev2": 328,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "perf_event_open": 298,
            "process_madvise": 440,
            "cachestat": 451,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "io_setup": 206,
            "io_submit": 209,
        },
    ),
    "aarch64": (
        0xC00000B7,
        0,
        {
            "flock": 32,
            "fcntl": 25,
            "inotify_init1": 26,
            "mincore": 232,
            "madvise": 233,
            "readahead": 213,
            "fadvise64": 223,
            "preadv2": 286,
            "pwritev2": 287,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "perf_event_open": 241,
            "process_madvise": 440,
            "cachestat": 451,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "io_setup": 0,
            "io_submit": 2,
        },
    ),
}
F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 5, 6, 7, 36, 37, 38
RWF_NOWAIT = 8
MADV_COLD, MADV_PAGEOUT = 20, 21
# Refused (EPERM): concurrent runs signal through inotify; the page cache of the files all
# runs read is tested (mincore, cachestat, a read that fails rather than wait for the disk)
# or emptied (fadvise, madvise's cold/pageout) by them; readahead loads pages unseen.
_DENIED = (
    "inotify_init",
    "inotify_init1",
    "mincore",
    "readahead",
    "fadvise64",
    "cachestat",
    "process_madvise",
    "perf_event_open",
)
# Unsupported (ENOSYS), as on a kernel without them: the keyrings of the reused run uids
# outlive a run; io_uring's and Linux AIO's reads carry their flags (RWF_NOWAIT) where
# seccomp cannot see them.
_ABSENT = (
    "add_key",
    "request_key",
    "keyctl",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "io_setup",
    "io_submit",
)


def filter_covert_syscalls() -> None:
    """Install a seccomp filter (inherited by every child) against covert channels between
    runs: file locks, inotify, page-cache residency, keyrings; syscalls of another
    architecture's ABI are refused outright."""
    fprog = compiled_filter()
    if fprog is None:
        return
    # prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog): no_new_privs is already set.
    check(libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0), "seccomp")


@functools.cache
def compiled_filter() -> ctypes.Structure | None:
    """The filter as a `struct sock_fprog`, built once (the server builds it before it forks
    runs); None on an architecture we have no syscall numbers for."""
    import errno
    import platform

    spec = _SECCOMP_ARCH.get(platform.machine())
    if spec is None:
        return None
    arch, x32, nr = spec
    allow, fake_ok = 0x7FFF0000, 0x00050000
    deny, absent = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    arg_low = lambda i: 16 + 8 * i  # noqa: E731  offset of seccomp_data.args[i], low half
    # (code, true target, false target, k); targets are labels or None (next instruction).
    prog: list[tuple[int, str | None, str | None, int]] = [
        (ld, None, None, 4),  # seccomp_data.arch
        (jeq, None, "deny", arch),
        (ld, None, None, 0),  # seccomp_data.nr
    ]
    if x32:
        prog.append((jge, "deny", None, x32))
    prog.append((jeq, "fake_ok", None, nr["flock"]))
    prog += [(jeq, "deny", None, nr[name]) for name in _DENIED if name in nr]
    prog += [(jeq, "absent", None, nr[name]) for name in _ABSENT]
    prog += [
        (jeq, "fcntl", None, nr["fcntl"]),
        (jeq, "rwf", None, nr["preadv2"]),
        (jeq, "rwf", None, nr["pwritev2"]),
        (jeq, "madvise", None, nr["madvise"]),
        (ret, None, None, allow),
    ]
    labels = {"fcntl": len(prog)}
    prog.append((ld, None, None, arg_low(1)))  # the fcntl command
    prog += [(jeq, "deny", None, cmd) for cmd in (F_GETLK, F_OFD_GETLK)]
    prog += [(jeq, "fake_ok", None, cmd) for cmd in (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW)]
    prog.append((ret, None, None, allow))
    labels["rwf"] = len(prog)
    prog += [
        (ld, None, None, arg_low(5)),
        (jset, "deny", None, RWF_NOWAIT),
        (ret, None, None, allow),
    ]
    labels["madvise"] = len(prog)
    prog.append((ld, None, None, arg_low(2)))  # the advice
    prog += [(jeq, "deny", None, advice) for advice in (MADV_COLD, MADV_PAGEOUT)]
    prog.append((ret, None, None, allow))
    for label, action in (("fake_ok", fake_ok), ("deny", deny), ("absent", absent)):
        labels[label] = len(prog)
        prog.append((ret, None, None, action))

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
    fprog._keep = code  # the instructions live as long as the program struct
    return fprog
