"""Nothing a run leaves in the kernel reaches the next run: page-cache residency, keyrings.

Each test is an attack by two cooperating runs of one sandbox, one after the other (a sender,
say a hidden-test run, and a receiver, say the next visible run whose output the coder reads).
"""

from __future__ import annotations

import os
import random
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from masenvs.sandbox import Sandbox, SandboxLimits

FAST = SandboxLimits(cpu_seconds=5.0, wall_seconds=10.0, memory_mb=256)
CHUNK = 64 * 1024  # apart enough that the kernel's readahead of one never reaches the next


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    with Sandbox(FAST) as sandbox:
        if not sandbox.isolation.allow_list:
            pytest.skip(f"no allow-list root on this machine ({sandbox.isolation.mode})")
        yield sandbox


def shared_file() -> Path:
    """A large standard-library file every run can read and no process keeps mapped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return max(stdlib.glob("ensurepip/_bundled/*.whl"), key=lambda p: p.stat().st_size)


def evict(path: Path) -> None:
    """What memory pressure on the host does to pages nobody uses: drop them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


SENDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
for i, bit in enumerate(sys.argv[2]):
    if bit == "1":
        os.pread(fd, 1, (i + 1) * {chunk})
print("sent")
"""

# Residency probes: each reports which chunks are in the page cache without loading them.
PROBES = {
    "timing": """
        import os, sys, time
        fd = os.open(sys.argv[1], os.O_RDONLY)
        times = []
        for i in range(int(sys.argv[2])):
            t = time.perf_counter_ns()
            os.pread(fd, 1, (i + 1) * CHUNK)
            times.append(time.perf_counter_ns() - t)
        cut = (min(times) * max(times)) ** 0.5  # cold (a disk read) is 10-100x warm
        print("".join("1" if t < cut and max(times) > 8 * min(times) else "0" for t in times))
    """,
    "mincore": """
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        fd, n = os.open(sys.argv[1], os.O_RDONLY), int(sys.argv[2])
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        vec = ctypes.create_string_buffer(size // 4096 + 1)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore refused")
        print("".join("1" if vec.raw[(i + 1) * CHUNK // 4096] & 1 else "0" for i in range(n)))
    """,
    "nowait": """
        import os, sys
        fd = os.open(sys.argv[1], os.O_RDONLY)
        bits = []
        for i in range(int(sys.argv[2])):
            try:
                os.preadv(fd, [bytearray(1)], (i + 1) * CHUNK, os.RWF_NOWAIT)
                bits.append("1")
            except BlockingIOError:
                bits.append("0")
        print("".join(bits))
    """,
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_page_cache_residency_carries_nothing_to_the_next_run(sb: Sandbox, probe: str) -> None:
    path = shared_file()
    n = min(30, path.stat().st_size // CHUNK - 1)
    message = "".join(random.choice("01") for _ in range(n - 2)) + "01"
    evict(path)
    sent = sb.run(textwrap.dedent(SENDER).format(chunk=CHUNK), args=[str(path), message])
    assert sent.ok, sent.stderr
    source = f"CHUNK = {CHUNK}\n" + textwrap.dedent(PROBES[probe])
    got = sb.run(source, args=[str(path), str(n)])
    # Refused (an error) or blind: either way the message does not arrive.
    assert not (got.ok and got.stdout.strip() == message), (probe, got.stdout, got.stderr)


def test_probing_syscalls_are_refused(sb: Sandbox) -> None:
    """fadvise (evict, or warm silently), mincore, RWF_NOWAIT reads, readahead, cachestat and
    io_uring (whose reads seccomp cannot inspect) fail as unsupported or not permitted."""
    res = sb.run(
        textwrap.dedent(
            """
            import ctypes, errno, os, sys
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(sys.argv[1], os.O_RDONLY)
            def refused(call):
                try:
                    call()
                except OSError as exc:
                    return exc.errno in (errno.EPERM, errno.ENOSYS)
                return False
            def sys_(nr, *a):
                rc = libc.syscall(nr, *a)
                if rc < 0:
                    raise OSError(ctypes.get_errno(), "refused")
            out = {
                "fadvise": refused(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),
                "nowait": refused(lambda: os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)),
                "readahead": refused(lambda: sys_(187, fd, ctypes.c_long(0), 4096)),
                "mincore": refused(lambda: sys_(27, ctypes.c_void_p(0), 4096, ctypes.c_void_p(0))),
                "cachestat": refused(lambda: sys_(451, fd, ctypes.c_void_p(0), ctypes.c_void_p(0), 0)),
                "io_uring": refused(lambda: sys_(425, 8, ctypes.c_void_p(0))),
                "aio": refused(lambda: sys_(206, 8, ctypes.byref(ctypes.c_ulong(0)))),
            }
            # Reading normally still works, with or without the other preadv2 flags.
            assert os.preadv(fd, [bytearray(4)], 0) == 4
            print(sorted(k for k, v in out.items() if not v))
            """
        ),
        args=[str(shared_file())],
    )
    assert res.ok, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


LOOKUP_SENDER = """
import os, sys
for i, bit in enumerate(sys.argv[2]):
    if bit == "1":
        for copy in range(3):  # each bit in three names: a vote against noise
            os.path.exists(f"{sys.argv[1]}{i}-{copy}")  # leaves a negative dentry
print("sent")
"""
LOOKUP_RECEIVER = """
import os, sys, time
times = []
for i in range(int(sys.argv[2])):
    for copy in range(3):
        t = time.perf_counter_ns()
        os.path.exists(f"{sys.argv[1]}{i}-{copy}")
        times.append(time.perf_counter_ns() - t)
zeros = sorted(times[3 * i + c] for i in range(8, 32, 2) for c in range(3))  # warm preamble
ones = sorted(times[3 * i + c] for i in range(9, 32, 2) for c in range(3))
cut = (zeros[len(zeros) // 2] * ones[len(ones) // 2]) ** 0.5
votes = ["1" if t < cut else "0" for t in times]
print("".join(max("01", key=votes[3 * i : 3 * i + 3].count) for i in range(len(times) // 3)))
"""


def test_a_missing_name_looked_up_carries_nothing_to_the_next_run(sb: Sandbox) -> None:
    """A lookup of a name that does not exist leaves a negative dentry where the directory
    lives; in a host file system the next lookup of that name is faster (1.5 vs 2.6 us)."""
    where = Path(sysconfig.get_paths()["stdlib"])  # every run sees it, a large directory
    prefix = f"{where}/.masenvs-probe-{random.getrandbits(40):x}-"
    message = "01" * 16 + "".join(random.choice("01") for _ in range(96))
    assert sb.run(LOOKUP_SENDER, args=[prefix, message]).stdout == "sent\n"
    got = sb.run(LOOKUP_RECEIVER, args=[prefix, str(len(message))])
    assert got.ok, got.stderr
    errors = sum(a != b for a, b in zip(got.stdout.strip()[32:], message[32:]))
    assert errors > len(message[32:]) // 5, (errors, got.stdout, message)  # a coin, not a wire


KEYRING = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING = -4, -3
if sys.argv[1] == "send":
    for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING):
        libc.syscall(248, b"user", b"masenvs-covert", b"SECRET-42", 9, ring)  # add_key
    print("sent")
else:
    for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING):
        key = libc.syscall(250, 10, ring, b"user", b"masenvs-covert", 0)  # keyctl(SEARCH)
        if key > 0:
            buf = ctypes.create_string_buffer(64)
            n = libc.syscall(250, 11, ctypes.c_long(key), buf, 64)  # keyctl(READ)
            print(buf.raw[:n].decode())
    print("done")
"""


def test_a_kernel_key_does_not_reach_the_next_run(sb: Sandbox) -> None:
    # Runs one after the other reuse a few uid slots: a key in a uid's keyring would wait
    # there for whichever later run gets that uid.
    for _ in range(4):
        assert sb.run(KEYRING, args=["send"]).stdout == "sent\n"
        time.sleep(0.05)
    for _ in range(4):
        got = sb.run(KEYRING, args=["receive"])
        assert got.ok, got.stderr
        assert "SECRET-42" not in got.stdout
        time.sleep(0.05)
