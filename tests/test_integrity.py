"""Integrity under attack, through the public entry points only (issue 26).

Each test plays a hostile client or policy: raw sockets that stream bodies with no, a
negative or a chunked length into the auto-MAS gate, `masenvs serve` and `masenvs
search-serve` (real server processes, whose memory is read from /proc), parameters out
of range, JSON nested 200k deep, a design asking for sampling settings the env did not
set, and a checkpoint save killed at its worst moment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20


# -- helpers: server processes, their memory, hostile bodies ----------------------------------


def memory_mb(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@contextlib.contextmanager
def server_process(args: list[str], ready: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A subprocess started with `args`; yields (process, the first match of regex `ready`
    in its output)."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(ready, line)
            if found:
                yield proc, found
                return
        raise AssertionError(f"{args} did not start:\n{''.join(lines)}")
    finally:
        proc.kill()
        proc.wait(10)


def stream_body(sock: socket.socket, head: bytes, total: int, *, chunked: bool) -> tuple[int, int]:
    """Send `head`, then up to `total` body bytes (raw or chunked), stopping as soon as the
    server answers or stops reading; returns (the answer's status or 0, bytes sent)."""
    sock.sendall(head)
    piece = b"x" * MB
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece
    sent = 0
    try:
        while sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable or not writable:
                break  # an answer, or a server that stopped reading
            sent += sock.send(frame[: len(frame)])
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            else:
                sock.shutdown(socket.SHUT_WR)  # no length: the body ends at EOF
    except (BrokenPipeError, ConnectionResetError):
        pass
    return status_of(sock), sent


def status_of(sock: socket.socket) -> int:
    sock.settimeout(60)
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    found = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(found.group(1)) if found else 0


def post_raw(sock: socket.socket, path: str, body: bytes, headers: str = "") -> int:
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n".encode()
        + body
    )
    return status_of(sock)


DEEP = b"[" * 200_000 + b"]" * 200_000


# -- the auto-MAS gate --------------------------------------------------------------------------

GATE_SERVER = """
import sys, time
from masenvs.mas.gate import Gate
gate = Gate("http://127.0.0.1:9", "r-hostile", {"executor": "executor"})
print("gate at", gate.path, flush=True)
time.sleep(600)
"""


@pytest.fixture
def gate_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A gate in a process of its own (as in the trainer), its Unix socket's path."""
    env = {"MASENVS_GATE_DIR": str(tmp_path / "gates")}
    with server_process([sys.executable, "-c", GATE_SERVER], r"gate at (\S+)", env) as (p, m):
        yield p, m.group(1)


def unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


@pytest.mark.parametrize(
    "length",
    ["Content-Length: -1\r\n", "Transfer-Encoding: chunked\r\n", ""],
    ids=["-1", "chunked", "none"],
)
def test_the_gate_refuses_unbounded_bodies_while_they_stream(gate_process, length: str) -> None:
    proc, path = gate_process
    before = memory_mb(proc.pid)[1]
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: gate\r\n{length}\r\n".encode()
    with unix(path) as sock:
        status, sent = stream_body(sock, head, 64 * MB, chunked="chunked" in length)
    grown = memory_mb(proc.pid)[1] - before
    assert status in (400, 411, 413), status
    assert sent < 64 * MB, "the gate answered only after the whole body"
    assert grown < 16, f"the gate's process grew {grown:.0f} MiB"
    with unix(path) as sock:  # and it still serves the next design
        assert post_raw(sock, "/v1/chat/completions", DEEP) == 400  # 200k-deep JSON


# -- masenvs serve ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_process() -> Iterator[tuple[subprocess.Popen, int]]:
    args = [sys.executable, "-m", "masenvs.cli", "serve", "--model", "tiny", "--port", "0"]
    with server_process(args, r"http://127\.0\.0\.1:(\d+)/v1") as (proc, found):
        yield proc, int(found.group(1))


def test_serve_refuses_a_chunked_body_past_its_cap_while_it_streams(serve_process) -> None:
    proc, port = serve_process
    before = memory_mb(proc.pid)[1]
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        status, sent = stream_body(sock, head, 48 * MB, chunked=True)  # the cap is 32 MB
    grown = memory_mb(proc.pid)[1] - before
    assert status == 413 and sent < 48 * MB
    assert grown < 48, f"serve grew {grown:.0f} MiB for a body refused at 32 MiB"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert post_raw(sock, "/v1/chat/completions", b"0", "Content-Length: -1\r\n") == 400


def test_serve_caps_prompts_in_characters_before_tokenizing(serve_process) -> None:
    proc, port = serve_process
    before = memory_mb(proc.pid)[1]
    prompt = "lorem ipsum dolor " * (4 * MB // 18)  # 4 MB: ~75x that to tokenize
    reply = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": prompt}]},
        timeout=120,
    )
    grown = memory_mb(proc.pid)[1] - before
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert grown < 64, f"serve grew {grown:.0f} MiB for a prompt it refused"


def test_serve_answers_deep_json_with_400(serve_process) -> None:
    _, port = serve_process
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = httpx.post(f"http://127.0.0.1:{port}{path}", content=DEEP, timeout=60)
        assert reply.status_code == 400, reply.text
        assert "nested" in reply.json()["error"]["message"]
    shallow_but_deep = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    node: Any = shallow_but_deep
    for _ in range(100):  # under the recursion limit, over any request's needs
        node["x"] = {}
        node = node["x"]
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=shallow_but_deep)
    assert reply.status_code == 400


# -- masenvs search-serve -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from masenvs.search.data import generate_encyclopedia, write_corpus_jsonl

    return write_corpus_jsonl(
        generate_encyclopedia(300, seed=0).docs, tmp_path_factory.mktemp("c") / "c.jsonl"
    )


@contextlib.contextmanager
def search_serve(corpus: Path, *extra: str) -> Iterator[tuple[subprocess.Popen, int]]:
    args = [sys.executable, "-m", "masenvs.cli", "search-serve", str(corpus), "--port", "0"]
    with server_process([*args, *extra], r"http://[^:]+:(\d+)/retrieve") as (proc, found):
        yield proc, int(found.group(1))


@pytest.mark.parametrize(
    "length", ["Content-Length: -1\r\n", "Transfer-Encoding: chunked\r\n"], ids=["-1", "chunked"]
)
def test_search_serve_refuses_unbounded_bodies_while_they_stream(corpus: Path, length: str) -> None:
    with search_serve(corpus) as (proc, port):
        before = memory_mb(proc.pid)[1]
        head = f"POST /retrieve HTTP/1.1\r\nHost: x\r\n{length}\r\n".encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            status, sent = stream_body(sock, head, 64 * MB, chunked="chunked" in length)
        grown = memory_mb(proc.pid)[1] - before
        assert status in (400, 411, 413) and sent < 64 * MB
        assert grown < 16, f"search-serve grew {grown:.0f} MiB"


def test_search_serve_validates_every_parameter(corpus: Path) -> None:
    with search_serve(corpus) as (_, port):
        url = f"http://127.0.0.1:{port}/retrieve"
        ok = httpx.post(url, json={"queries": ["mentor"], "topk": 2})
        assert ok.status_code == 200 and len(ok.json()["result"][0]) == 2
        bad = [
            {"queries": ["mentor"], "topk": -5},
            {"queries": ["mentor"], "topk": 0},
            {"queries": ["mentor"], "topk": 10**9},  # would return the whole corpus
            {"queries": ["mentor"], "topk": "3"},
            {"queries": ["mentor"], "topk": True},
            {"queries": ["mentor"], "topk": 2.5},
            {"queries": []},
            {"queries": ["q"] * 10_000},
            {"queries": ["x" * 100_000]},
            {"queries": ["mentor"], "return_scores": "yes"},
            ["not", "an", "object"],
        ]
        for body in bad:
            reply = httpx.post(url, json=body)
            assert reply.status_code == 400, (body if len(str(body)) < 100 else "...", reply.text)
        assert httpx.post(url, content=DEEP).status_code == 400
        assert httpx.post(url, json={"queries": ["mentor"], "topk": 2}).status_code == 200


# -- the gate enforces the env's sampling settings --------------------------------------------


GREEDY_DESIGN = """
async def solve(messages):
    reply = await current().client.chat.completions.create(
        model="executor@solver", messages=messages, n=16, max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True, "seed": 7},
    )
    return "\\\\boxed{%d}" % len(reply.choices)
"""


def test_the_gate_samples_as_the_env_says_whatever_the_design_asks(tmp_path: Path) -> None:
    from framework_support import serve

    from masenvs.adapters.backends.embedded import EmbeddedBackend
    from masenvs.mas.design import DesignRunner
    from masenvs.mas.gate import Gate

    backend = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=512)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    asked = {
        "model": "executor@solver",
        "messages": question,
        "n": 16,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {"0": 100},
        "seed": 7,
    }
    try:
        with serve(backend, tmp_path / "traces", policy_map={"executor": "base"}) as served:
            # A design in the sandbox, as the auto-MAS env runs it (env: 6 tokens at T=0.7).
            runner = DesignRunner(served.url, max_tokens=6, temperature=0.7, seconds=30)
            run = runner.run(GREEDY_DESIGN, question, "mas-design-0")
            assert run.ok and run.answer == "\\boxed{1}", (run.error, run.answer)
            # The same request sent raw to a gate's socket.
            gate = Gate(served.url, "mas-x-0", {"executor": "executor"}, max_tokens=8)
            with gate, unix(gate.path) as sock:
                assert post_raw(sock, "/v1/chat/completions", json.dumps(asked).encode()) == 200
            (designed,) = served.store.rollout("mas-design-0")
            (raw,) = served.store.rollout("mas-x-0")
    finally:
        backend.shutdown()
    for record, max_tokens, temperature in ((designed, 6, 0.7), (raw, 8, 1.0)):
        assert len(record.choices) == 1 and len(record.choices[0].token_ids) <= max_tokens
        params = record.params
        assert (params["n"], params["max_tokens"]) == (1, max_tokens)
        assert params["temperature"] == temperature  # the env's, or the endpoint's default
        assert not params["ignore_eos"] and params["seed"] is None
    # What the gate changed is in the call's record, for whoever reads the trace.
    assert designed.metadata["gate"] == {
        "n": 16,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "seed": 7,
    }
    assert raw.metadata["gate"] == {
        "n": 16,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": '{"0": 100}',
        "seed": 7,
    }


# -- checkpoints: re-saving a step, killed at every moment ---------------------------------------

RESAVER = textwrap.dedent(
    """
    import json, os, shutil, signal, sys
    from pathlib import Path
    from masenvs.trainer import checkpoint as ckpt

    class Learner:  # what save_checkpoint asks of a learner, with a visible version mark
        policies, full, sharded = ["policy"], False, False
        def __init__(self, mark):
            self.mark = mark
        def save_adapter(self, policy, directory):
            Path(directory).mkdir(parents=True)
            (Path(directory) / "adapter_model.safetensors").write_text(self.mark * 4096)
        def state_dict(self):
            return {"mark": self.mark}

    # fsync guards against power loss, not kill -9; stubbed, the test runs in seconds.
    ckpt._fsync = lambda path: None

    def resave(run_dir, kill_at):
        ckpt.save_checkpoint(run_dir, Learner("A"), ckpt.TrainState(7, 56))
        if sys.argv[2] == "1":  # as on a system without renameat2
            ckpt._exchange = lambda a, b: False
        calls = 0
        def dying(real):
            def call(*args, **kwargs):
                nonlocal calls
                out = real(*args, **kwargs)
                calls += 1
                if calls == kill_at:  # right after this step of the save
                    os.kill(os.getpid(), signal.SIGKILL)
                return out
            return call
        for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree"),
                             (ckpt, "_exchange"), (ckpt, "_fsync")):
            if hasattr(module, name):
                setattr(module, name, dying(getattr(module, name)))
        ckpt.save_checkpoint(run_dir, Learner("B"), ckpt.TrainState(7, 56))  # the same step

    # One process per kill point, forked after the imports (which take seconds, some lazily
    # in the first save).
    ckpt.save_checkpoint(os.path.join(sys.argv[1], "warm-up"), Learner("A"), ckpt.TrainState(1, 8))
    for kill_at in range(1, 100):
        run_dir = os.path.join(sys.argv[1], f"run{kill_at}")
        pid = os.fork()
        if pid == 0:
            resave(run_dir, kill_at)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"run_dir": run_dir, "killed": killed, "status": status}), flush=True)
        if not killed:
            break
    """
)


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
def test_a_step_saved_again_survives_a_kill_at_any_moment(tmp_path: Path, fallback: bool) -> None:
    from masenvs.trainer.checkpoint import load_latest

    script = tmp_path / "resave.py"
    script.write_text(RESAVER)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(int(fallback))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(runs) > 4 and runs[-1] == {**runs[-1], "killed": False, "status": 0}, proc.stderr
    for run in runs:  # killed after each step of the save, then the save that finished
        loaded = load_latest(run["run_dir"])
        assert loaded is not None and loaded.state.step == 7, (run, proc.stderr[-2000:])
        adapter = loaded.path / "adapters" / "policy" / "adapter_model.safetensors"
        assert adapter.read_text() in ("A" * 4096, "B" * 4096), run
    assert adapter.read_text() == "B" * 4096  # the save that ran to its end holds the new one
