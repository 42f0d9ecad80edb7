"""The seccomp filter every program runs under where runs have the allow-list root.

Runs in the server from a staged copy: standard library only.
"""

from __future__ import annotations

import ctypes

from .runsetup import check, libc

# Syscalls by which two concurrent runs could still signal each other through the files
# they share read-only: file locks (set: pretend success, so no lock is ever held across
# runs; test: refused) and inotify (refused). Per architecture: (audit arch, flock, fcntl,
# inotify syscalls, an x32-style bit that must not be set).
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 73, 72, (253, 294), 0x40000000),
    "aarch64": (0xC00000B7, 32, 25, (26,), 0),
}
F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 5, 6, 7, 36, 37, 38


def filter_covert_syscalls() -> None:
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
    check(libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0), "seccomp")
