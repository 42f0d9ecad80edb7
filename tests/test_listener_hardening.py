"""Every listener under a hostile client (issue 41), through real server processes on
127.0.0.1: bodies that parse into millions of objects, keys on screen, in `ps` and in
access logs, and idle or trickling connections held open to lock everyone else out.

The bodies are those of the review: 30 MB of `[{},{},...]` to `serve` (+1.4 GB and 15 s
of CPU before its 400 when nothing counted what a body parses into), 4 MB to the
auto-MAS gate, 1 MB to `search-serve`; each server's peak memory is read from /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from masenvs import listeners

MB = 1 << 20
KEY = "k3y-that-must-stay-secret-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def empty_objects(size: int) -> bytes:
    """`[{},{},...]` of about `size` bytes: three bytes per object once parsed."""
    return b"[" + b",".join([b"{}"] * (size // 3)) + b"]"


# -- helpers: server processes and their memory ----------------------------------------------


def peak_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM), in MiB."""
    found = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(found.group(1)) / 1024


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh at the current RSS, so a test sees only its own peak."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def server(
    args: list[str], ready: str, env: dict[str, str] | None = None, max_files: int = 0
) -> Iterator[Any]:
    """A server process (with at most `max_files` open files, if given); yields (process,
    the match of `ready` in its output, output lines so far: a list that keeps growing
    while the process prints)."""

    def limit_files() -> None:
        if max_files:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, hard))

    environ = {k: v for k, v in os.environ.items() if "API_KEY" not in k}
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**environ, **(env or {})},
        preexec_fn=limit_files,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        found = None
        while found is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"{args} did not start:\n{''.join(lines)}")
            lines.append(line)
            found = re.search(ready, line)
        assert found is not None, "".join(lines)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        yield proc, found, lines
    finally:
        proc.kill()
        proc.wait(10)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "masenvs.cli", *args]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from masenvs.search.data import generate_encyclopedia, write_corpus_jsonl

    return write_corpus_jsonl(
        generate_encyclopedia(50, seed=0).docs, tmp_path_factory.mktemp("c") / "c.jsonl"
    )


@pytest.fixture(scope="module")
def serve() -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """`masenvs serve --model tiny` with its key in the environment (as users give it)."""
    ready = r"at (http://127\.0\.0\.1:\d+)/v1"
    env = {"MASENVS_API_KEY": KEY}
    with server(cli("serve", "--model", "tiny", "--port", "0"), ready, env) as (proc, found, out):
        time.sleep(0.5)  # the rest of the banner
        yield proc, found.group(1), out


# -- bounded parsing ---------------------------------------------------------------------------


def parsed_size(value: Any) -> tuple[int, int]:
    """(objects and arrays, values and keys) of a parsed JSON value."""
    if isinstance(value, dict):
        inner = [parsed_size(v) for v in value.values()]
        return 1 + sum(c for c, _ in inner), 1 + len(value) + sum(i for _, i in inner)
    if isinstance(value, list):
        inner = [parsed_size(v) for v in value]
        return 1 + sum(c for c, _ in inner), 1 + sum(i for _, i in inner)
    return 0, 1


def test_the_size_of_a_body_is_counted_before_it_is_parsed() -> None:
    from masenvs.request_bodies import BodyError, JsonLimits, json_size, parse_json

    limits = JsonLimits(max_bytes=MB, max_containers=100, max_items=1000)
    assert json_size(b'{"a": [1, 2, {"b": null}], "c": "x"}') == (3, 10)
    # Brackets, commas and colons inside strings (code, JSON in a tool call) are text.
    text = b'{"content": "f(a, b) {return [a, b];} \\"{[,:\\" \\\\", "n": 1}'
    assert json_size(text) == (1, 5)
    assert parse_json(text, limits)["n"] == 1
    # Exact for what json.loads builds, whatever the strings hold (escapes included).
    tricky = ["\\", '\\"', 'a"b', "{[,:]}", "\\\\", "é\u2028", '\\\\"x']
    for value in [*tricky, {"k": tricky, "m": [[1, {"z": None}], "s"]}, [tricky, {"q": 1}]]:
        raw = json.dumps(value).encode()
        assert json_size(raw) == parsed_size(json.loads(raw)), raw
    for body in (empty_objects(10_000), b"[" * 5000, b"[" + b"1," * 5000 + b"1]"):
        with pytest.raises(BodyError) as refused:
            parse_json(body, limits)
        assert refused.value.status == 400
        assert re.search("at most|nested deeper", str(refused.value))
    with pytest.raises(BodyError, match="not JSON"):
        parse_json(b'{"a": ', limits)


def test_serve_refuses_30_mb_of_empty_objects_before_parsing_them(serve: Any) -> None:
    proc, url, _ = serve
    reset_peak(proc.pid)
    before, cpu = peak_mb(proc.pid), cpu_seconds(proc.pid)
    started = time.monotonic()
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        content=empty_objects(30 * MB),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=120,
    )
    took, grown = time.monotonic() - started, peak_mb(proc.pid) - before
    cpu = cpu_seconds(proc.pid) - cpu
    print(f"30 MB of {{}}: {reply.status_code} in {took:.1f} s, +{grown:.0f} MiB, {cpu:.1f} s CPU")
    assert reply.status_code == 400, reply.text
    assert "objects and arrays" in reply.json()["error"]["message"]
    assert grown < 128, f"serve grew {grown:.0f} MiB for a 30 MB body"
    assert cpu < 3, f"serve spent {cpu:.1f} s of CPU on a body it refused"
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert chat.status_code == 200  # and it still serves


GATE_SERVER = """
import sys, time
from masenvs.mas.gate import Gate
gate = Gate("http://127.0.0.1:9", "r-hostile", {"executor": "executor"})
print("gate at", gate.path, flush=True)
time.sleep(600)
"""


@pytest.fixture
def gate() -> Iterator[tuple[subprocess.Popen, str]]:
    """A gate in a process of its own (as in the trainer), its Unix socket's path."""
    # Short: a socket's path fits 107 bytes, and xdist's tmp_path is longer than that.
    with tempfile.TemporaryDirectory(prefix="gates-") as gates:
        env = {"MASENVS_GATE_DIR": gates}
        with server([sys.executable, "-c", GATE_SERVER], r"gate at (\S+)", env) as (proc, found, _):
            yield proc, found.group(1)


def unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def post_raw(sock: socket.socket, path: str, body: bytes) -> int:
    """POST `body` on `sock`; the answer's status (0 if the connection closed first)."""
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return status_of(sock)


def status_of(sock: socket.socket) -> int:
    """The status of the answer that arrives on `sock` (0 if it closes first)."""
    sock.settimeout(30)
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    found = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(found.group(1)) if found else 0


def concurrently(n: int, call: Any) -> list[Any]:
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        results[i] = call()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    return results


def test_the_gate_refuses_4_mb_of_empty_objects_before_parsing_them(gate: Any) -> None:
    proc, path = gate
    body = empty_objects(4 * MB - 16)
    reset_peak(proc.pid)
    before = peak_mb(proc.pid)

    def attack() -> int:
        with unix(path) as sock:
            return post_raw(sock, "/v1/chat/completions", body)

    statuses = concurrently(8, attack)
    grown = peak_mb(proc.pid) - before
    print(f"8 x 4 MB of {{}} to the gate: {statuses}, +{grown:.0f} MiB")
    assert set(statuses) == {400}, statuses
    assert grown < 80, f"the gate grew {grown:.0f} MiB for 8 bodies of 4 MB"
    with unix(path) as sock:
        assert post_raw(sock, "/v1/tools/python", empty_objects(MB - 16)) == 400


def test_search_serve_refuses_1_mb_of_empty_objects_before_parsing_them(corpus: Path) -> None:
    ready = r"(http://127\.0\.0\.1:\d+/retrieve)"
    with server(cli("search-serve", str(corpus), "--port", "0"), ready) as (proc, found, _):
        url, body = found.group(1), empty_objects(MB - 10)
        reset_peak(proc.pid)
        before = peak_mb(proc.pid)
        replies = concurrently(16, lambda: httpx.post(url, content=body, timeout=60))
        grown = peak_mb(proc.pid) - before
        statuses = [r.status_code for r in replies]
        print(f"16 x 1 MB of {{}} to search-serve: {statuses}, +{grown:.0f} MiB")
        assert set(statuses) == {400}, statuses
        assert "objects and arrays" in replies[0].json()["error"]
        assert grown < 40, f"search-serve grew {grown:.0f} MiB for 16 bodies of 1 MB"
        assert httpx.post(url, json={"queries": ["mentor"]}).status_code == 200


def test_the_ui_refuses_request_bodies(tmp_path: Path) -> None:
    ready = r"http://localhost:(\d+)/"
    with server(cli("ui", str(tmp_path), "--port", "0"), ready) as (proc, found, _):
        port = int(found.group(1))
        reset_peak(proc.pid)
        before = peak_mb(proc.pid)
        for method, length in [("GET", 30 * MB), ("POST", 30 * MB), ("POST", None)]:
            framing = f"Content-Length: {length}" if length else "Transfer-Encoding: chunked"
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    f"{method} / HTTP/1.1\r\nHost: localhost\r\n{framing}\r\n\r\n".encode()
                )
                with contextlib.suppress(OSError):
                    sock.sendall(empty_objects(MB) if length else b"100000\r\n" + b"x" * MB)
                assert status_of(sock) == 413, (method, framing)
        grown = peak_mb(proc.pid) - before
        assert grown < 32, f"the ui grew {grown:.0f} MiB"
        page = httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": "localhost"})
        assert page.status_code == 200


# -- keys: never printed, never in argv, never logged -----------------------------------------


def test_serve_never_prints_its_key(serve: Any) -> None:
    proc, url, out = serve
    printed = "".join(out)
    assert KEY not in printed, printed
    assert "key: set" in printed and "MASENVS_API_KEY" in printed  # the snippet names it
    assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401


@pytest.mark.parametrize("command", ["serve", "search-serve", "ui"])
def test_a_key_on_the_command_line_is_refused(command: str, corpus: Path) -> None:
    args = {
        "serve": ["--model", "tiny"],
        "search-serve": [str(corpus)],
        "ui": [str(corpus.parent)],
    }[command]
    try:
        done = subprocess.run(
            cli(command, *args, "--port", "0", "--api-key", KEY),
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} started with its key on the command line")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--api-key-file" in done.stderr and "API_KEY" in done.stderr
    assert KEY not in done.stdout + done.stderr


def test_search_serve_reads_its_key_from_a_file(corpus: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    args = cli("search-serve", str(corpus), "--port", "0", "--api-key-file", str(key_file))
    with server(args, r"(http://127\.0\.0\.1:\d+/retrieve)") as (proc, found, out):
        url = found.group(1)
        assert httpx.post(url, json={"queries": ["mentor"]}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(url, json={"queries": ["mentor"]}, headers=auth).status_code == 200
        assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        time.sleep(0.2)
        assert KEY not in "".join(out) and "key: set" in "".join(out)


@pytest.mark.parametrize("level", ["info", "trace"])
def test_the_ui_logs_no_key(tmp_path: Path, level: str) -> None:
    args = cli("ui", str(tmp_path), "--port", "0", "--log-level", level)
    ready = r"(http://localhost:\d+/)"
    with server(args, ready, {"MASENVS_API_KEY": KEY}) as (proc, found, out):
        url = found.group(1).replace("localhost", "127.0.0.1")
        opened = httpx.get(f"{url}?key={KEY}&tab=x", follow_redirects=False)
        assert opened.status_code == 303 and opened.cookies
        assert httpx.get(url, cookies=opened.cookies).status_code == 200
        assert httpx.get(f"{url}?key=wrong").status_code == 401
        time.sleep(0.5)
        printed = "".join(out)
        assert "GET /" in printed  # the access log is on
        assert KEY not in printed and "key=wrong" not in printed, printed
        assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()


# -- connections: idle or trickling clients cannot lock anyone out ----------------------------


def test_idle_and_trickling_connections_cannot_lock_out_search_serve(corpus: Path) -> None:
    from masenvs.search.server import MAX_CONNECTIONS

    ready = r"(http://127\.0\.0\.1:(\d+)/retrieve)"
    with server(cli("search-serve", str(corpus), "--port", "0"), ready) as (_, found, _):
        url, port = found.group(1), int(found.group(2))
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
        for sock in held[::2]:  # half of them send a request head they never finish
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
        try:
            time.sleep(0.5)
            started = time.monotonic()
            for _ in range(5):
                reply = httpx.post(url, json={"queries": ["mentor"]}, timeout=10)
                assert reply.status_code == 200, reply.text
            assert time.monotonic() - started < 5
        finally:
            for sock in held:
                sock.close()


def test_idle_connections_cannot_lock_a_design_out_of_its_gate(gate: Any) -> None:
    from masenvs.mas.gate import MAX_CONNECTIONS

    _, path = gate
    held = [unix(path) for _ in range(MAX_CONNECTIONS + 16)]
    try:
        time.sleep(0.5)
        with unix(path) as sock:  # a well-formed call is answered, not refused with 503
            assert post_raw(sock, "/v1/chat/completions", b'{"model": "nope"}') == 400
    finally:
        for sock in held:
            sock.close()


def test_serve_closes_connections_that_send_no_request(serve: Any) -> None:
    head_timeout = getattr(listeners, "HEAD_TIMEOUT", 10.0)
    _, url, _ = serve
    port = int(url.rsplit(":", 1)[1])
    idle = socket.create_connection(("127.0.0.1", port))
    trickle = socket.create_connection(("127.0.0.1", port))
    try:
        started = time.monotonic()
        for sock in (idle, trickle):
            sock.settimeout(head_timeout + 5)
        trickle.sendall(b"GET /v1/models HTTP/1.1\r\n")
        assert idle.recv(1) == b"" and trickle.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < head_timeout + 3
    finally:
        idle.close()
        trickle.close()


def test_idle_connections_cannot_use_up_the_file_descriptors_of_serve() -> None:
    # A server started with 256 open files allowed (many systems start processes with
    # 1024): idle sockets would use them all up, and accept() would fail for everyone.
    cap = getattr(listeners, "open_connections_cap", lambda: 1024)()
    ready = r"at (http://127\.0\.0\.1:(\d+))/v1"
    args = cli("serve", "--model", "tiny", "--port", "0")
    with server(args, ready, max_files=256) as (proc, found, out):
        url, port = found.group(1), int(found.group(2))
        held = []
        try:
            for _ in range(cap + 200):
                held.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(1)
            started = time.monotonic()
            reply = httpx.get(f"{url}/v1/models", timeout=5)
            assert reply.status_code == 200 and time.monotonic() - started < 3
            files = len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))
            assert files < cap + 128, (files, cap)  # idle ones were closed to make room
            assert "Too many open files" not in "".join(out)
        finally:
            for sock in held:
                sock.close()
