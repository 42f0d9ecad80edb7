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
import tempfile
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


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh at the current RSS, so a test sees only its own peak."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


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
def gate_process() -> Iterator[tuple[subprocess.Popen, str]]:
    """A gate in a process of its own (as in the trainer), its Unix socket's path."""
    # Short: a socket's path fits 107 bytes, and xdist's tmp_path is longer than that.
    with tempfile.TemporaryDirectory(prefix="gates-") as gates:
        env = {"MASENVS_GATE_DIR": gates}
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
    reset_peak(proc.pid)
    before = memory_mb(proc.pid)[1]
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: gate\r\n{length}\r\n".encode()
    with unix(path) as sock:
        status, sent = stream_body(sock, head, 64 * MB, chunked="chunked" in length)
    grown = memory_mb(proc.pid)[1] - before
    print(f"peak RSS growth: {grown:.1f} MiB")  # shown with pytest -s
    assert status in (400, 411, 413), status
    assert sent < 64 * MB, "the gate answered only after the whole body"
    assert grown < 16, f"the gate's process grew {grown:.0f} MiB"
    with unix(path) as sock:  # and it still serves the next design
        assert post_raw(sock, "/v1/chat/completions", DEEP) == 400  # 200k-deep JSON


def test_a_design_cannot_make_its_gate_start_a_thread_per_connection(gate_process) -> None:
    from masenvs.mas import gate as gate_module

    proc, path = gate_process
    cap = getattr(gate_module, "MAX_CONNECTIONS", 64)
    before = threads(proc.pid)
    idle = [unix(path) for _ in range(cap + 200)]
    try:
        time.sleep(1)
        assert threads(proc.pid) <= before + cap, threads(proc.pid)
        with unix(path) as sock:  # an idle connection made room for it (issue 41)
            assert post_raw(sock, "/v1/chat/completions", b"{}") == 400
    finally:
        for sock in idle:
            sock.close()
    time.sleep(1)
    with unix(path) as sock:  # the slots came back
        assert post_raw(sock, "/v1/chat/completions", b"{}") == 400


def threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"Threads:\s+(\d+)", status).group(1))


# -- masenvs serve ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_process() -> Iterator[tuple[subprocess.Popen, int]]:
    args = [sys.executable, "-m", "masenvs.cli", "serve", "--model", "tiny", "--port", "0"]
    with server_process(args, r"http://127\.0\.0\.1:(\d+)/v1") as (proc, found):
        yield proc, int(found.group(1))


def test_serve_refuses_a_chunked_body_past_its_cap_while_it_streams(serve_process) -> None:
    proc, port = serve_process
    reset_peak(proc.pid)
    before = memory_mb(proc.pid)[1]
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        status, sent = stream_body(sock, head, 48 * MB, chunked=True)  # the cap is 32 MB
    grown = memory_mb(proc.pid)[1] - before
    print(f"peak RSS growth: {grown:.1f} MiB")  # shown with pytest -s
    assert status == 413 and sent < 48 * MB
    assert grown < 48, f"serve grew {grown:.0f} MiB for a body refused at 32 MiB"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert post_raw(sock, "/v1/chat/completions", b"0", "Content-Length: -1\r\n") == 400


def test_serve_bounds_many_bodies_arriving_at_once(serve_process) -> None:
    proc, port = serve_process
    reset_peak(proc.pid)
    before = memory_mb(proc.pid)[1]
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * MB
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    statuses: dict[int, int] = {}
    try:
        for sock in socks:
            sock.sendall(head)
            sock.settimeout(30)
        for _ in range(30):  # 20 bodies of 30 MB, each under the cap, all arriving together
            for i, sock in enumerate(socks):
                if i in statuses:
                    continue
                if select.select([sock], [], [], 0)[0]:
                    statuses[i] = status_of(sock)
                    continue
                try:
                    sock.sendall(frame)
                except OSError:
                    statuses[i] = status_of(sock)
        for i, sock in enumerate(socks):
            if i not in statuses:
                with contextlib.suppress(OSError):
                    sock.sendall(b"0\r\n\r\n")
                statuses[i] = status_of(sock)
    finally:
        for sock in socks:
            sock.close()
    grown = memory_mb(proc.pid)[1] - before
    print(f"peak RSS growth: {grown:.1f} MiB")  # shown with pytest -s
    assert 503 in statuses.values(), statuses  # over the budget some wait for another time
    assert set(statuses.values()) <= {400, 503}, statuses
    assert grown < 400, f"serve grew {grown:.0f} MiB for 600 MB arriving at once"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    after = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=60)
    assert after.status_code == 200  # the budget came back


def test_serve_caps_prompts_in_characters_before_tokenizing(serve_process) -> None:
    proc, port = serve_process
    reset_peak(proc.pid)
    before = memory_mb(proc.pid)[1]
    prompt = "lorem ipsum dolor " * (4 * MB // 18)  # 4 MB: ~75x that to tokenize
    reply = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": prompt}]},
        timeout=120,
    )
    grown = memory_mb(proc.pid)[1] - before
    print(f"peak RSS growth: {grown:.1f} MiB")  # shown with pytest -s
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


def test_serve_bounds_what_each_decoding_step_checks(serve_process) -> None:
    _, port = serve_process
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stop in (["a"] * 100_000, "x" * 1_000_000):  # each looked for after every token
        reply = httpx.post(url, json={**chat, "stop": stop}, timeout=60)
        assert reply.status_code == 400 and "stop" in reply.text
    assert httpx.post(url, json={**chat, "stop": ["\n", "END"]}, timeout=60).status_code == 200


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
        reset_peak(proc.pid)
        before = memory_mb(proc.pid)[1]
        head = f"POST /retrieve HTTP/1.1\r\nHost: x\r\n{length}\r\n".encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            status, sent = stream_body(sock, head, 64 * MB, chunked="chunked" in length)
        grown = memory_mb(proc.pid)[1] - before
        print(f"peak RSS growth: {grown:.1f} MiB")  # shown with pytest -s
        assert status in (400, 411, 413) and sent < 64 * MB
        assert grown < 16, f"search-serve grew {grown:.0f} MiB"


def test_search_serve_bounds_idle_connections(corpus: Path) -> None:
    from masenvs.search import server

    cap = getattr(server, "MAX_CONNECTIONS", 128)

    with search_serve(corpus) as (proc, port):
        url = f"http://127.0.0.1:{port}/retrieve"
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap + 200)]
        try:
            time.sleep(1)
            assert threads(proc.pid) <= cap + 8  # not one per idle socket
            served = httpx.post(url, json={"queries": ["mentor"]}, timeout=30)
            assert served.status_code == 200  # an idle connection made room (issue 41)
        finally:
            for sock in idle:
                sock.close()
        time.sleep(1)
        assert httpx.post(url, json={"queries": ["mentor"]}, timeout=30).status_code == 200


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

    from masenvs.engine.engine import EmbeddedBackend
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
    from masenvs.trainer.run import checkpoint as ckpt

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
    from masenvs.trainer.run.checkpoint import load_latest

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


# -- the sandbox: hidden tests out of reach, runs isolated, results from the harness ----------
#
# A "universal cheat" looks the hidden tests up wherever masenvs and its data live on this
# machine: the checkout (tasks, tests/data), its .git objects through `git show`, installed
# copies in site-packages, another copy and a jsonl dataset it finds in /var/tmp. It plays
# the coder of the code env, an auto-MAS design and the Verilog verifier; on the old
# sandbox (the host's files minus the imported package's tasks/) it earned full reward.

CHEAT_CORE = r"""
import glob as _glob, io as _io, json as _json, os as _os, subprocess as _sp, sys as _sys
import types as _types

_PLACES = %(places)r
_REPOS = %(repos)r


def _code_tasks_from_py(text):
    records = _types.ModuleType("masenvs.tasks.records")

    class TestCase:
        def __init__(self, input, output):
            self.input, self.output = input, output

    class CodeTask:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    records.TestCase, records.CodeTask = TestCase, CodeTask
    fake = {"masenvs": _types.ModuleType("masenvs"), "masenvs.tasks": _types.ModuleType("t"),
            "masenvs.tasks.records": records}
    saved = {k: _sys.modules.get(k) for k in fake}
    _sys.modules.update(fake)
    try:
        ns = {"__name__": "_loot"}
        exec(text, ns)
    finally:
        for k, v in saved.items():
            if v is None:
                _sys.modules.pop(k, None)
            else:
                _sys.modules[k] = v
    return [{"prompt": p.prompt, "fn_name": getattr(p, "fn_name", None),
             "tests": [[c.input, c.output] for c in (*p.tests, *p.public_tests)]}
            for p in ns["PROBLEMS"]]


def _texts():
    for pattern in _PLACES:
        for path in sorted(_glob.glob(_os.path.expanduser(pattern))):
            try:
                with open(path, encoding="utf-8") as f:
                    yield path, f.read()
            except (OSError, UnicodeDecodeError):
                pass
    for repo in _REPOS:
        for rel in ("masenvs/tasks/code_problems.py", "masenvs/tasks/data/verilog_problems.json"):
            try:
                out = _sp.run(["git", "-c", "safe.directory=*", "-C", repo,
                               "show", "HEAD:" + rel], capture_output=True, text=True, timeout=20)
                if out.returncode == 0:
                    yield rel, out.stdout
            except (OSError, _sp.SubprocessError):
                pass


def hunt():
    code, verilog, seen = [], [], []
    for path, text in _texts():
        seen.append(path)
        try:
            if path.endswith("code_problems.py"):
                code += _code_tasks_from_py(text)
            elif path.endswith("verilog_problems.json"):
                verilog += _json.loads(text)
            elif path.endswith(".jsonl"):
                for line in text.splitlines():
                    d = _json.loads(line)
                    if "golden" in d:
                        verilog.append(d)
                    elif "tests" in d:
                        tests = d["tests"] + d.get("public_tests", [])
                        code.append({"prompt": d["prompt"], "fn_name": d.get("fn_name"),
                                     "tests": [[c["input"], c["output"]] for c in tests]})
        except Exception:
            pass
    return code, verilog, seen
"""

CODER_CHEAT = r"""
_code, _, _ = hunt()
_tables = {}
for _task in _code:
    for _inp, _out in _task["tests"]:
        key = _json.dumps(_inp) if _task["fn_name"] else " ".join(str(_inp).split())
        _tables.setdefault(_task["fn_name"], {})[key] = _out
for _fn, _tab in _tables.items():
    if _fn:
        globals()[_fn] = (lambda tab: lambda *a: tab.get(_json.dumps(list(a))))(_tab)
if __name__ == "__main__":
    print(_tables.get(None, {}).get(" ".join(_sys.stdin.read().split()), ""))
"""

DESIGN_CHEAT = r"""
async def solve(messages):
    question = messages[-1]["content"]
    code, _, _ = hunt()
    for task in code:
        if task["prompt"][:80] not in question:
            continue
        if task["fn_name"]:
            table = {_json.dumps(i): o for i, o in task["tests"]}
            program = (f"import json\nT = json.loads({_json.dumps(table)!r})\n"
                       f"def {task['fn_name']}(*a):\n    return T.get(json.dumps(list(a)))\n")
        else:
            table = {" ".join(str(i).split()): o for i, o in task["tests"]}
            program = (f"import json, sys\nT = json.loads({_json.dumps(table)!r})\n"
                       "print(T.get(' '.join(sys.stdin.read().split()), ''))\n")
        return "```python\n" + program + "```"
    return ""  # nothing found: no answer, no bonus
"""

VERIFIER_CHEAT = r"""
_raw = _sys.stdin.read()
_sys.stdin = _io.StringIO(_raw)  # the judge's driver reads the request after us
_req = _json.loads(_raw)
_, _golden, _ = hunt()
_outs = [[n, w] for n, w in _req["outputs"]]
_found = [t for t in _golden if [list(v) for v in t["vectors"]] == _req["sequences"][0]
          and [[p[0], p[2]] for p in t["ports"] if p[1] == "output"] == _outs]
_made = [0]


class RefModel:
    def __init__(self):
        if not _found:
            raise LookupError("no golden vectors anywhere")
        self.seq, self.i = _made[0], 0
        _made[0] += 1

    def step(self, inputs):
        rows = _found[0]["expected"]
        row = rows[self.i] if self.seq == 0 and self.i < len(rows) else ["0"] * len(_outs)
        self.i += 1
        return {n: int(b.replace("x", "0").replace("z", "0"), 2) for (n, _), b in zip(_outs, row)}


def stimulus():
    return []
"""


@pytest.fixture(scope="module")
def loot() -> Iterator[dict[str, Any]]:
    """Hidden tests in every place a policy might look, and the cheat's map of them."""
    import shutil
    import site

    from masenvs.tasks.code_problems import PROBLEMS
    from masenvs.tasks.loaders import write_jsonl

    copy = Path(f"/var/tmp/masenvs-integrity-{os.getpid()}")  # another copy of masenvs
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(REPO / "masenvs" / "tasks", copy / "masenvs" / "tasks")
    write_jsonl(PROBLEMS, copy / "code.jsonl")  # a `jsonl:` dataset
    copy.chmod(0o755)
    for path in copy.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    site_dirs = [*site.getsitepackages(), *sys.path]
    places = [
        f"{REPO}/masenvs/tasks/code_problems.py",
        f"{REPO}/masenvs/tasks/data/verilog_problems.json",
        f"{REPO}/tests/data/*.jsonl",
        f"{copy}/masenvs/tasks/code_problems.py",
        f"{copy}/masenvs/tasks/data/verilog_problems.json",
        f"{copy}/*.jsonl",
        "/var/tmp/*/masenvs/tasks/code_problems.py",
        "/work/*/masenvs/tasks/code_problems.py",
        "~/.cache/masenvs/*/*.jsonl",
        *(f"{d}/masenvs/tasks/code_problems.py" for d in site_dirs if d),
        *(f"{d}/masenvs/tasks/data/verilog_problems.json" for d in site_dirs if d),
    ]
    core = CHEAT_CORE % {"places": places, "repos": [str(REPO)]}
    try:
        yield {"core": core, "copy": copy, "jsonl": copy / "code.jsonl", "places": places}
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_the_cheat_finds_the_hidden_tests_outside_the_sandbox(loot) -> None:
    """The cheat works: run here, outside any sandbox, it finds every hidden test."""
    from masenvs.tasks.code_problems import PROBLEMS

    namespace: dict[str, Any] = {"__name__": "probe"}
    exec(loot["core"] + "\nFOUND = hunt()\n", namespace)
    code, verilog, seen = namespace["FOUND"]
    assert {t["prompt"] for t in code} >= {p.prompt for p in PROBLEMS}
    assert len(verilog) >= 50 and "masenvs/tasks/code_problems.py" in seen  # from .git
    assert str(loot["jsonl"]) in seen


def test_the_cheat_earns_nothing_as_the_coder(loot) -> None:
    import masenvs
    from masenvs.tasks.code_problems import PROBLEMS

    action = f"```python\n{loot['core']}\n{CODER_CHEAT}\n```"
    for source, problems in (("builtin", PROBLEMS), (f"jsonl:{loot['jsonl']}", PROBLEMS[:2])):
        env = masenvs.make("code", source=source, single_agent=True)
        for problem in problems:
            env.reset(seed=0, options={"task": problem})
            _, rewards, _, _, infos = env.step({"coder": action})
            assert infos["coder"]["pass_rate"] == 0.0, (source, problem.id)
            assert rewards["coder"] == 0.0, (source, problem.id)


def test_no_hidden_test_file_is_even_visible_to_a_run(loot) -> None:
    """Through the code judge: a program lists what it can open of the places and of the
    host (home, checkout, .git, caches, site-packages of the trainer)."""
    from masenvs.tasks.code_judge import CodeJudge
    from masenvs.tasks.records import TestCase

    site_dirs = [d for d in sys.path if d.endswith("site-packages")]
    targets = [*loot["places"], str(loot["copy"]), str(REPO), f"{REPO}/.git", "/var/tmp"]
    targets += [str(Path.home()), os.path.expanduser("~/.cache"), *site_dirs]
    probe = textwrap.dedent(
        f"""
        import glob, json, os
        seen = {{}}
        for pattern in {targets!r}:
            for path in glob.glob(os.path.expanduser(pattern)) or [pattern]:
                try:
                    seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else "file"
                    open(path, "rb").close() if seen[path] == "file" else None
                except OSError:
                    seen.pop(path, None)
        print(json.dumps(seen))
        """
    )
    room = "{}" + " " * 20000  # the judge keeps twice the expected output of a case
    (result,) = CodeJudge().run(probe, [TestCase("", room)]).cases
    assert result.status in ("pass", "wrong"), result
    seen = json.loads(result.actual)
    assert not any(isinstance(v, str) for v in seen.values()), seen  # no hidden file opens
    # What exists of the host is the way to the interpreter and its allowed packages: the
    # checkout holds only its .venv, the home only the interpreter, site-packages no masenvs.
    assert seen.get(str(REPO), [".venv"]) == [".venv"], seen
    assert seen.get(str(Path.home()), [".pyenv"]) in ([".pyenv"], []), seen
    for name in (str(loot["copy"]), f"{REPO}/.git", "/var/tmp", os.path.expanduser("~/.cache")):
        assert name not in seen, seen
    for site_dir in site_dirs:
        assert not any("masenvs" in entry for entry in seen.get(site_dir, [])), seen


AUTO_MAS_SAMPLE = (0, 3, 8, 13)  # two stdin and two call-based problems


def test_the_cheat_earns_nothing_as_an_auto_mas_design(loot) -> None:
    import masenvs
    from masenvs.tasks.code_problems import PROBLEMS

    design = f"<code>\n{loot['core']}\n{DESIGN_CHEAT}\n</code>"
    env = masenvs.make(
        "auto_mas",
        task="code",
        endpoint_url="http://127.0.0.1:9",  # never called: the design makes no LLM call
        executions=1,
        max_rounds=1,
        design_seconds=60,
    )
    for index in AUTO_MAS_SAMPLE:
        env.reset(seed=0, options={"task": PROBLEMS[index]})
        _, rewards, _, _, infos = env.step({"designer": design})
        (execution,) = infos["designer"]["executions"]
        assert execution["correctness"] == 0.0, (PROBLEMS[index].id, execution)
        assert rewards["designer"] == 0.0, (PROBLEMS[index].id, execution)
    # What the design's sandbox shows of the places, the checkout and masenvs' task modules.
    targets = [*loot["places"], str(REPO / "masenvs"), str(REPO / ".git")]
    probe = (
        "async def solve(messages):\n"
        "    import glob, json, os\n"
        f"    seen = [p for t in {targets!r} for p in glob.glob(os.path.expanduser(t))]\n"
        "    try:\n"
        "        import masenvs.tasks.code_problems\n"
        "        seen.append('import masenvs.tasks')\n"
        "    except ImportError:\n"
        "        pass\n"
        "    return json.dumps(seen)\n"
    )
    env.reset(seed=0, options={"task": PROBLEMS[0]})
    _, _, _, _, infos = env.step({"designer": f"<code>\n{probe}\n</code>"})
    (execution,) = infos["designer"]["executions"]
    assert execution["answer"] == "[]", execution


VERILOG_SAMPLE = ("and_or_xor", "alu_8bit", "popcount_8", "counter_4bit", "lfsr_8bit", "dff_reset")


def test_the_cheat_earns_nothing_as_the_verilog_verifier(loot) -> None:
    import masenvs
    from masenvs.tasks.verilog_problems import builtin_tasks

    tasks = {t.id: t for t in builtin_tasks()}
    env = masenvs.make("verilog")
    action = f"```python\n{loot['core']}\n{VERIFIER_CHEAT}\n```"
    for task_id in VERILOG_SAMPLE:
        env.reset(seed=0, options={"task": tasks[task_id]})
        env.step({"designer": "```verilog\nmodule top_module(); endmodule\n```"})
        _, rewards, _, _, infos = env.step({"verifier": action})
        assert infos["verifier"]["verifier_agreement"] is None, task_id
        assert rewards["verifier"] == 0.0, task_id


# -- runs are isolated from each other -------------------------------------------------------

LEAVER = r"""
import ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size = 200 << 20
shm = libc.shmget(0x5EED26, size, 0o1666)  # IPC_CREAT: outlives the process that made it
addr = libc.shmat(shm, None, 0)
ctypes.memset(addr, 0x41, size)  # really allocate it
libc.shmdt(ctypes.c_void_p(addr))
with open("/dev/shm/masenvs-left", "wb") as f:
    f.write(b"hidden input 1 2 3")
with open("/tmp/masenvs-left", "w") as f:
    f.write("hidden input 1 2 3")
if os.fork() == 0:  # a detached listener on an abstract socket
    os.setsid()
    s = socket.socket(socket.AF_UNIX)
    s.bind(b"\0masenvs-left")
    s.listen()
    time.sleep(60)
    os._exit(0)
time.sleep(0.2)
print("left", shm >= 0)
"""

FINDER = r"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
found = []
if libc.shmget(0x5EED26, 0, 0) >= 0:
    found.append("sysv-shm")
for path in ("/dev/shm/masenvs-left", "/tmp/masenvs-left"):
    if os.path.exists(path):
        found.append(path)
try:
    socket.socket(socket.AF_UNIX).connect(b"\0masenvs-left")
    found.append("abstract-socket")
except OSError:
    pass
print("found", found)
"""


def host_shmem_mb() -> float:
    """Shared memory and tmpfs pages of the whole host (every namespace), in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["Shmem"].split()[0]) / 1024


def test_nothing_a_run_leaves_behind_reaches_the_next_and_memory_returns() -> None:
    import ctypes

    from masenvs.tasks.code_judge import CodeJudge
    from masenvs.tasks.records import TestCase

    judge = CodeJudge(memory_mb=768)
    before = host_shmem_mb()
    try:
        (left,) = judge.run(LEAVER, [TestCase("", "left True\n")]).cases
        assert left.status == "pass", left  # it did allocate 200 MB and left it all behind
        (seen,) = judge.run(FINDER, [TestCase("", "found []\n")]).cases
        assert seen.status == "pass", seen.actual  # the next run finds none of it
        deadline = time.monotonic() + 20  # the kernel frees a dead namespace's memory lazily
        while host_shmem_mb() - before > 100 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert host_shmem_mb() - before < 100, (before, host_shmem_mb())
    finally:  # on a sandbox without IPC namespaces the segment sits in the host's
        libc = ctypes.CDLL(None, use_errno=True)
        shm = libc.shmget(0x5EED26, 0, 0)
        if shm >= 0:
            libc.shmctl(shm, 0, None)  # IPC_RMID


MEET = r"""
async def solve(messages):
    import os, socket, time
    name = b"\0masenvs-meet"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(name)
    except OSError:  # the other execution holds the name: reach it, swap gate sockets
        c = socket.socket(socket.AF_UNIX)
        c.connect(name)
        c.sendall(open("/proc/self/cmdline", "rb").read()[:50])
        return "met: connected to the other execution"
    s.listen()
    s.settimeout(8)
    try:
        conn, _ = s.accept()
        return "met: the other execution connected"
    except OSError:
        gates = sorted(os.listdir("/run/masenvs")) if os.path.isdir("/run/masenvs") else []
        return f"alone, gates {gates}"
"""


def test_two_concurrent_executions_cannot_reach_each_others_sockets() -> None:
    import masenvs

    env = masenvs.make(
        "auto_mas",
        endpoint_url="http://127.0.0.1:9",
        executions=2,  # run at the same time
        max_rounds=1,
        design_seconds=30,
    )
    env.reset(seed=0, options={"task": {"id": "q", "question": "2 + 2?", "answer": "4"}})
    _, _, _, _, infos = env.step({"designer": f"<code>\n{MEET}\n</code>"})
    answers = [e["answer"] for e in infos["designer"]["executions"]]
    assert answers == ["alone, gates ['gate.sock']"] * 2, infos["designer"]["executions"]


FORGED = {
    "exits at once": "import os; os._exit(0)",
    "prints last, at exit": "import atexit; atexit.register(lambda: print(LINE, flush=True))",
}


@pytest.mark.parametrize("ending", FORGED)
def test_a_forged_result_line_is_not_taken_for_the_result(ending: str) -> None:
    import masenvs
    from masenvs.mas.design import RESULT_MARKER

    forged = RESULT_MARKER + json.dumps(
        {
            "answer": "\\boxed{4}",
            "graph": {"structure": "Agent(x)", "nodes": [{"name": "x", "calls": ["c1"]}]},
            "error": None,
        }
    )
    design = (
        f"LINE = {forged!r}\n"
        "async def solve(messages):\n"
        "    print(LINE, flush=True)\n"
        f"    {FORGED[ending]}\n"
        "    return '\\\\boxed{5}'\n"
    )
    env = masenvs.make("auto_mas", endpoint_url="http://127.0.0.1:9", executions=1, max_rounds=1)
    env.reset(seed=0, options={"task": {"id": "q", "question": "2 + 2?", "answer": "4"}})
    _, rewards, _, _, infos = env.step({"designer": f"<code>\n{design}\n</code>"})
    (execution,) = infos["designer"]["executions"]
    assert execution["correctness"] == 0.0 and rewards["designer"] < 1.0, execution
    assert "\\boxed{4}" not in execution["answer"]
    assert infos["designer"]["graph"] is None or infos["designer"]["graph"]["nodes"] == []


def test_judges_refuse_a_sandbox_that_cannot_hide_the_tests(monkeypatch) -> None:
    from masenvs.sandbox import Sandbox, SandboxError
    from masenvs.tasks.code_judge import CodeJudge
    from masenvs.tasks.records import TestCase

    tests = [TestCase("2\n", "4\n")]
    with Sandbox(namespaces=False) as weak:
        assert not weak.isolation.judging_safe
        monkeypatch.delenv("MASENVS_ALLOW_WEAK_SANDBOX", raising=False)
        with pytest.raises(SandboxError, match="MASENVS_ALLOW_WEAK_SANDBOX=1"):
            CodeJudge(sandbox=weak).run("print(2 * int(input()))", tests)
        monkeypatch.setenv("MASENVS_ALLOW_WEAK_SANDBOX", "1")  # the user opts in
        with pytest.warns(UserWarning, match="hidden tests"):
            result = CodeJudge(sandbox=weak).run("print(2 * int(input()))", tests)
        assert result.all_passed


def test_a_gate_dir_too_long_for_a_socket_is_a_clear_error(tmp_path: Path) -> None:
    long = tmp_path / ("d" * 100)
    done = subprocess.run(
        [sys.executable, "-c", GATE_SERVER],
        capture_output=True,
        text=True,
        env={**os.environ, "MASENVS_GATE_DIR": str(long)},
        timeout=60,
    )
    assert done.returncode != 0
    assert "too long for a unix socket" in done.stderr and "AF_UNIX" not in done.stderr
