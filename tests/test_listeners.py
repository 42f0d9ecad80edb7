"""No open listener beyond loopback (issue 32): each masenvs server bound to a non-loopback
address of this machine refuses to start without a key (or generates one), answers 401
without it and serves with it; the trainer's endpoint hands its per-run key to Ray workers
through Ray, and the workers sample through it."""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from masenvs.listeners import ListenerError, announce, listener_key
from masenvs.search.backends import HttpBackend


def this_machines_address() -> str:
    """A non-loopback IPv4 address of this machine (the one its default route leaves by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.254", 9))  # no packet is sent: this only picks a route
            address = sock.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


@contextlib.contextmanager
def process(args: list[str], ready: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A server process; yields (process, the match of `ready` in its output, the output)."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        seen = []
        while True:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"{args} did not start:\n{''.join(seen)}")
            seen.append(line)
            found = re.search(ready, line)
            if found:
                yield proc, found, seen
                return
    finally:
        proc.kill()
        proc.wait(10)


def refused(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run a server command that must refuse to start; its error output."""
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr


def test_the_rule_refuses_generates_or_opens_with_a_warning(capsys: Any) -> None:
    assert listener_key("127.0.0.1", None, what="x") is None
    assert listener_key("::1", None, what="x") is None
    assert listener_key("0.0.0.0", "given", what="x") == "given"
    with pytest.raises(ListenerError, match="refusing to listen on 0.0.0.0"):
        listener_key("0.0.0.0", None, what="x")
    with pytest.raises(ListenerError):
        listener_key("my-host.example", None, what="x")  # a name may resolve anywhere
    one, two = (listener_key("0.0.0.0", None, what="x", generate=True) for _ in range(2))
    assert one and two and one != two and len(one) >= 32
    assert listener_key("0.0.0.0", None, what="x", no_auth=True) is None
    assert "WARNING" in capsys.readouterr().err
    assert "protected" in announce("x", "http://0.0.0.0:1", "k")
    assert "OPEN" in announce("x", "http://10.1.2.3:1/v1", None)
    assert "loopback" in announce("x", "http://127.0.0.1:1", None)


# -- search-serve -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from masenvs.search.data import generate_encyclopedia, write_corpus_jsonl

    return write_corpus_jsonl(
        generate_encyclopedia(100, seed=0).docs, tmp_path_factory.mktemp("c") / "c.jsonl"
    )


def test_search_serve_beyond_loopback_needs_a_key(corpus: Path) -> None:
    host = this_machines_address()
    args = [sys.executable, "-m", "masenvs.cli", "search-serve", str(corpus), "--port", "0"]
    assert "refusing to listen on 0.0.0.0" in refused([*args, "--host", "0.0.0.0"])
    assert "refusing" in refused([*args, "--host", host], {"MASENVS_SEARCH_API_KEY": ""})

    env = {"MASENVS_SEARCH_API_KEY": "search-key"}  # from the environment, not a flag
    ready = r"listening: (http://\S+/retrieve)"
    with process([*args, "--host", host], ready, env) as (_, found, out):
        url = found.group(1)
        assert host in url and "protected" in out[-1]
        query = {"queries": ["mentor"], "topk": 2}
        assert httpx.post(url, json=query).status_code == 401
        wrong = httpx.post(url, json=query, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = httpx.post(url, json=query, headers={"Authorization": "Bearer search-key"})
        assert right.status_code == 200 and len(right.json()["result"][0]) == 2
        assert len(HttpBackend(url, api_key="search-key").search(["mentor"], 2)[0]) == 2

    with process([*args, "--host", host, "--no-auth"], ready) as (_, found, out):
        assert "OPEN" in out[-1]
        assert httpx.post(found.group(1), json={"queries": ["mentor"]}).status_code == 200


# -- serve --engine -----------------------------------------------------------------------------


def test_an_engine_server_beyond_loopback_needs_a_key() -> None:
    from masenvs.adapters.backends.launch import launch_engine_server

    host = this_machines_address()
    args = [sys.executable, "-m", "masenvs.cli", "serve", "--engine", "--model", "tiny"]
    no_key = {"MASENVS_API_KEY": ""}
    assert "refusing to listen on" in refused([*args, "--host", host, "--port", "0"], no_key)
    with pytest.raises(ListenerError, match="refusing"):
        launch_engine_server("tiny", host=host)

    handle = launch_engine_server("tiny", host=host, api_key="engine-key", timeout=120)
    try:
        assert host in handle.url
        assert "engine-key" not in " ".join(handle.command)  # in its environment, not argv
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"{handle.url}/v1/chat/completions"
        assert httpx.post(url, json=chat, timeout=60).status_code == 401
        load = httpx.post(f"{handle.url}/v1/load_lora_adapter", json={"lora_name": "x"})
        assert load.status_code == 401  # the weight routes too
        ok = httpx.post(url, json=chat, headers={"Authorization": "Bearer engine-key"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"]
        assert "protected" in handle.log_tail()
    finally:
        handle.stop()


# -- the trainer's capture endpoint ---------------------------------------------------------------


def tiny_run(run_dir: Path, *overrides: str) -> Any:
    from masenvs.trainer.config import load_config

    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            "model.name=tiny",
            "env.name=plan_path",
            "env.options={size: 4}",
            "steps=1",
            "rollout.branches=2",
            "rollout.max_rounds=1",
            "rollout.max_tokens=8",
            "rollout.tasks_per_step=2",
            "validation.every=0",
            "logging.tensorboard=false",
            "lora.rank=4",
            "backend.dtype=float32",
            *overrides,
        ],
    )


def test_the_trainer_endpoint_gets_a_key_beyond_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from masenvs.trainer.run.train import endpoint_binding

    monkeypatch.delenv("MASENVS_API_KEY", raising=False)
    remote = ("distributed.ray_address=auto", "distributed.rollout_workers=2")
    host, key = endpoint_binding(tiny_run(tmp_path, *remote))
    assert host == "0.0.0.0" and key and len(key) >= 32
    assert endpoint_binding(tiny_run(tmp_path, *remote))[1] != key  # one per run
    assert endpoint_binding(tiny_run(tmp_path)) == ("127.0.0.1", None)
    open_ = endpoint_binding(tiny_run(tmp_path, *remote, "distributed.endpoint_no_auth=true"))
    assert open_ == ("0.0.0.0", None) and "WARNING" in capsys.readouterr().err
    monkeypatch.setenv("MASENVS_API_KEY", "users-key")
    assert endpoint_binding(tiny_run(tmp_path, *remote))[1] == "users-key"


def command_lines() -> list[bytes]:
    """Every process's command line on this machine."""
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            out.append(path.read_bytes())
    return out


def test_ray_workers_sample_through_a_keyed_endpoint_on_this_machines_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from masenvs.traces import TraceStore
    from masenvs.trainer.rollout import workers as workers_module
    from masenvs.trainer.run import train as train_module
    from masenvs.trainer.run.metrics import read_metrics

    host = this_machines_address()
    monkeypatch.delenv("MASENVS_API_KEY", raising=False)
    seen: dict[str, Any] = {}
    real_start, real_dispatch = train_module.start_stack, workers_module.RolloutPool._dispatch

    def start_and_probe(**kwargs: Any) -> Any:
        stack = real_start(**kwargs)
        seen["key"], seen["url"] = stack.api_key, stack.root_url
        models = f"{stack.root_url}/v1/models"
        seen["no key"] = httpx.get(models).status_code
        seen["wrong key"] = httpx.get(models, headers={"Authorization": "Bearer x"}).status_code
        auth = {"Authorization": f"Bearer {stack.api_key}"}
        seen["with key"] = httpx.get(models, headers=auth).status_code
        return stack

    def dispatch_and_look(self: Any, *args: Any) -> Any:
        # While the workers run: the key is on no process's command line.
        seen["argv"] = command_lines()
        return real_dispatch(self, *args)

    monkeypatch.setattr(train_module, "start_stack", start_and_probe)
    monkeypatch.setattr(workers_module.RolloutPool, "_dispatch", dispatch_and_look)
    out = io.StringIO()
    cfg = tiny_run(
        tmp_path,
        "distributed.rollout_workers=2",
        f"distributed.endpoint_host={host}",  # beyond loopback, as remote workers need it
    )
    ray.init(
        num_cpus=3, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
    )
    try:
        session = Path(ray._private.worker._global_node.get_session_dir_path())  # noqa: SLF001
        train_module.train(cfg, console=Console(file=out, width=200))
    finally:
        ray.shutdown()

    key = seen["key"]
    assert key and host in seen["url"]
    assert (seen["no key"], seen["wrong key"], seen["with key"]) == (401, 401, 200)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/success" in r]
    assert rows and rows[0]["train/failed_tasks"] == 0 and rows[0]["train/dropped_tasks"] == 0
    calls = list(TraceStore(tmp_path / "traces").calls())
    assert {c.rollout_id.split("-")[0] for c in calls} == {"s1"} and len(calls) >= 4
    # Startup named the address and that it is protected; the key itself is nowhere.
    printed = out.getvalue()
    assert f"listening: {seen['url']}" in printed and "protected" in printed
    assert key not in printed
    assert not any(key.encode() in argv for argv in seen["argv"])
    for path in [*tmp_path.rglob("*"), *session.rglob("*")]:
        if path.is_file() and path.stat().st_size < 50 << 20:
            assert key.encode() not in path.read_bytes(), path


def test_docs_list_every_listener_and_its_key() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in ("distributed.md", "endpoint.md"):
        text = (docs / page).read_text()
        for listener in ("masenvs train", "masenvs serve", "serve --engine", "search-serve", "ui"):
            assert listener in text, (page, listener)
        assert "MASENVS_API_KEY" in text and "--no-auth" in text
