"""What the parent and the server say to each other: 4-byte length + JSON messages, and
where the host files a run request may carry (its binds) appear.

The server runs a staged copy of this file: standard library only.
"""

from __future__ import annotations

import json
import re
import socket
import struct

# Where host files given to one run (`binds`, e.g. an auto-MAS gate's socket) appear in it.
RUN_BIND_DIR = "/run/masenvs"
BIND_DIRS_MOUNT = "/run/masenvs-host"  # the server's view of Sandbox.bind_dirs
CGROUP_MOUNT = "/run/masenvs-cgroup"  # the server's memory cgroup, where runs get theirs
MAX_BINDS = 8
BIND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def send_msg(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))
