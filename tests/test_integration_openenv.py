"""masenvs envs behind an OpenEnv server, driven by the real `openenv-core` client over loopback;
and the other way round, an environment written for OpenEnv trained by `masenvs train`.

Every observation and reward the client sees is checked against the same episode played on
the masenvs env in-process (`TextEpisode`, seeds and actions fixed): a mapping adds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn  # noqa: E402
from openenv.core import GenericEnvClient  # noqa: E402
from openenv.core.env_server import Action, Environment, Observation, State, create_app  # noqa: E402
from websockets.asyncio.client import connect as ws_connect  # noqa: E402

from masenvs.integrations.episode import TextEpisode  # noqa: E402
from masenvs.integrations.openenv import create_server, uvicorn_config  # noqa: E402
from masenvs.registry import env_class, list_bridges, list_envs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


# --- a real server on loopback -------------------------------------------------------------------


@contextlib.contextmanager
def running(app: Any, config: uvicorn.Config | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    config = config or uvicorn.Config(app, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def masenvs_server(env: str, **kwargs: Any) -> Iterator[str]:
    app = create_server(env, **kwargs)
    with running(app, uvicorn_config(app)) as url:
        yield url


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def play(url: str, seed: int, actions: list[str], **reset: Any) -> dict[str, Any]:
    """One episode through the official async client: every observation, reward and state."""
    seen: dict[str, Any] = {"observations": [], "rewards": [], "dones": []}
    async with GenericEnvClient(base_url=url) as client:
        result = await client.reset(seed=seed, **reset)
        seen["observations"].append(result.observation)
        for action in actions:
            if result.done:
                break
            result = await client.step({"message": action})
            seen["observations"].append(result.observation)
            seen["rewards"].append(result.reward)
            seen["dones"].append(result.done)
        seen["state"] = await client.state()
    return seen


def local(env: str, seed: int, actions: list[str], **kwargs: Any) -> dict[str, Any]:
    """The same episode on the masenvs env in-process."""
    episode = TextEpisode(env, **kwargs)
    turn = episode.reset(seed=seed)
    seen: dict[str, Any] = {"prompts": [turn.text], "roles": [turn.role], "rewards": []}
    seen["messages"] = [turn.messages]
    for action in actions:
        if episode.done:
            break
        result = episode.step(action)
        seen["rewards"].append(result.reward)
        seen["prompts"].append(result.next.text if result.next else "")
        seen["roles"].append(result.next.role if result.next else None)
    seen["returns"] = episode.returns
    return seen


# --- same observations and rewards everywhere ------------------------------------------------------

ACTIONS = ["hello", '{"path": [[0, 0]]}', "Yes", "def f(): pass", "again"]


# The envs masenvs ships (not those an integration registers, which need a server or a taskset).
BUILTIN = [n for n in list_envs() if env_class(n).__module__.startswith("masenvs.envs.")]


@pytest.mark.parametrize("env", BUILTIN)
def test_client_sees_the_envs_own_observations_and_rewards(env: str) -> None:
    with masenvs_server(env) as url:
        for seed in (0, 1):
            got = run(play(url, seed, ACTIONS))
            want = local(env, seed, ACTIONS)
            assert [o["prompt"] for o in got["observations"]] == want["prompts"]
            assert [o["role"] for o in got["observations"]] == want["roles"]
            assert got["observations"][0]["messages"] == want["messages"][0]
            assert got["rewards"] == pytest.approx(want["rewards"])
            assert got["state"]["returns"] == pytest.approx(want["returns"])
            assert got["state"]["env"] == env


class FixedOpenAI(BaseHTTPRequestHandler):
    """A stand-in for `masenvs serve`: every chat completion answers REPLY."""

    REPLY = "I think the answer is 3."
    models: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.models.append(body["model"])
        data = json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": self.REPLY},
                    }
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def no_proxy_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """openenv-core's client sets NO_PROXY while it connects and restores it; concurrent
    connects of the official client in these tests must not leave it set for later tests."""
    for name in ("NO_PROXY", "no_proxy"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])  # put back as it is now
        else:  # recorded as absent (a bare delenv of an absent name records nothing)
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)


@pytest.fixture
def openai_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FixedOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FixedOpenAI.models.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_one_role_trained_while_a_url_plays_the_others(openai_url: str) -> None:
    from masenvs.integrations.episode import openai_player

    actions = ["(1, 1)", "[[0,0],[0,1]]", "hello"]
    with masenvs_server("plan_path", role="plan", others=openai_url) as url:
        got = run(play(url, 3, actions))
    want = local("plan_path", 3, actions, role="plan", others=openai_player(openai_url))
    assert {o["role"] for o in got["observations"] if o["role"]} == {"plan"}
    assert [o["prompt"] for o in got["observations"]] == want["prompts"]
    assert got["rewards"] == pytest.approx(want["rewards"])
    # The tool role's moves came from the URL, asked for by role name, and are shown.
    assert FixedOpenAI.models and set(FixedOpenAI.models) == {"tool"}
    assert ["tool", FixedOpenAI.REPLY] in got["observations"][1]["played"]


def test_an_unreachable_url_for_the_others_stops_the_episode_clearly() -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    url_of_nobody = f"http://127.0.0.1:{dead.getsockname()[1]}/v1"

    async def episode(url: str) -> None:
        async with GenericEnvClient(base_url=url) as client:
            with pytest.raises(RuntimeError, match="the episode stopped.*call reset"):
                await client.reset(seed=0)  # `tool` moves first, from the dead URL
            # Nothing is played as `tool` by the policy: the episode is over.
            with pytest.raises(RuntimeError, match="episode is over"):
                await client.step({"message": "hello"})

    with masenvs_server("plan_path", role="plan", others=url_of_nobody) as url:
        run(episode(url))
        assert httpx.get(f"{url}/health").json()["status"] == "healthy"
    dead.close()


# --- many sessions, bad input, bounded memory ------------------------------------------------------


def test_100_concurrent_sessions_are_isolated() -> None:
    async def one(url: str, seed: int) -> tuple[str, float, str]:
        async with GenericEnvClient(base_url=url) as client:
            first = await client.reset(seed=seed)
            word = re.search(r"Say (\w+)\.", first.observation["prompt"]).group(1)  # type: ignore[union-attr]
            await asyncio.sleep(0.05)  # every session is open at once
            result = await client.step({"message": word})
            state = await client.state()
            return word, result.reward or 0.0, state["episode_id"]

    async def all_of(url: str) -> list[tuple[str, float, str]]:
        return await asyncio.gather(*(one(url, seed) for seed in range(100)))

    with masenvs_server("say", max_sessions=128) as url:
        results = run(all_of(url))
        assert httpx.get(f"{url}/health").json()["status"] == "healthy"
    words = [local("say", seed, [])["prompts"][0].split("Say ")[1][:-1] for seed in range(100)]
    assert [w for w, _, _ in results] == words  # each session got its own seed's task
    assert all(reward == 1.0 for _, reward, _ in results)  # and its own reward
    assert len({episode for _, _, episode in results}) == 100


def test_malformed_requests_get_errors_and_the_server_stays_up() -> None:
    async def attack(url: str) -> list[dict[str, Any]]:
        replies = []
        async with ws_connect(url.replace("http", "ws") + "/ws", max_size=None) as ws:
            for raw in [
                "not json",
                json.dumps({"type": "launch"}),
                json.dumps({"type": "step", "data": {"message": "x"}}),  # before any reset
                json.dumps({"type": "reset", "data": {"seed": 0}}),
                json.dumps({"type": "step", "data": {"msg": "x"}}),
                json.dumps({"type": "step", "data": {"message": ["x"]}}),
                json.dumps({"type": "step", "data": "x"}),
                json.dumps({"type": "reset", "data": {"seed": -3}}),
                json.dumps({"type": "reset", "data": {"seed": 0, "colour": "red"}}),
                "[" * 100_000 + "]" * 100_000,  # deeper than any parser should go
                json.dumps({"type": "step", "data": {"message": "x" * 1_060_000}}),  # too long
                "[" + "{}," * 200_000 + "{}]",  # small on the wire, huge once parsed
                json.dumps({"type": "step", "data": {"message": "hello"}}),  # still served
            ]:
                await ws.send(raw)
                replies.append(json.loads(await ws.recv()))
        return replies

    with masenvs_server("plan_path", max_message_bytes=1 << 20) as url:
        replies = run(attack(url))
        kinds = [r["type"] for r in replies]
        assert kinds[:3] == ["error", "error", "error"]
        assert "reset" in replies[2]["data"]["message"]  # step before reset says what to do
        assert kinds[3] == "observation"
        assert kinds[4:12] == ["error"] * 8
        assert "colour" in replies[8]["data"]["message"]
        assert "bytes" in replies[10]["data"]["message"]
        assert kinds[12] == "observation"  # the session survived all of it
        assert replies[12]["data"]["reward"] == local("plan_path", 0, ["hello"])["rewards"][0]
        # HTTP: bodies bounded before they are read, garbage refused, the server still up.
        with httpx.Client(base_url=url, timeout=10) as http:
            big = http.post("/reset", content=b"{" + b" " * (2 << 20) + b"}")
            assert big.status_code == 413
            assert http.post("/step", content=b"garbage").status_code in (400, 422)
            stateless = http.post("/step", json={"action": {"message": "hi"}})
            assert stateless.status_code == 409 and "/ws" in stateless.json()["detail"]
            assert http.get("/health").json()["status"] == "healthy"
        assert run(play(url, 0, ["hello"]))["rewards"]
        # A frame far over the limit is not even buffered: the connection is closed (1009).
        assert run(oversized(url)) == 1009
        assert run(play(url, 0, ["hello"]))["rewards"]


async def oversized(url: str) -> int | None:
    async with ws_connect(url.replace("http", "ws") + "/ws", max_size=None) as ws:
        await ws.send(json.dumps({"type": "step", "data": {"message": "x" * 3_000_000}}))
        with contextlib.suppress(Exception):
            await ws.recv()
        await ws.wait_closed()
        return ws.close_code


def test_a_step_after_the_episode_ended_is_a_clear_error() -> None:
    async def episode(url: str) -> str:
        async with GenericEnvClient(base_url=url) as client:
            await client.reset(seed=0)
            first = await client.step({"message": "Yes"})  # say, single agent: one round
            assert first.done
            with pytest.raises(RuntimeError, match="episode is over; call reset") as info:
                await client.step({"message": "Yes"})
            again = await client.reset(seed=1)  # a new episode on the same session
            assert not again.done
            return str(info.value)

    with masenvs_server("say", options={"single_agent": True, "max_rounds": 1}) as url:
        assert "EXECUTION_ERROR" in run(episode(url))


def test_unknown_env_and_bad_options_stop_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from masenvs.cli import main

    def serve(*args: str) -> tuple[int, str]:
        code = main(["openenv-serve", *args, "--port", "0"])
        return code, capsys.readouterr().err

    code, err = serve("sokobna")
    assert code == 2 and "did you mean 'sokoban'" in err
    code, err = serve("sudoku", "--set", "sizee=4")
    assert code == 2 and "unknown option 'sizee' (did you mean 'size'?)" in err
    code, err = serve("plan_path", "--role", "planner")
    assert code == 2 and "'planner' is not one of them" in err
    code, err = serve("plan_path", "--role", "plan")
    assert code == 2 and "--others-url" in err
    monkeypatch.delenv("MASENVS_API_KEY", raising=False)
    code, err = serve("say", "--host", "0.0.0.0")
    assert code == 2 and "without an API key" in err
    code, err = serve("say", "--api-key", "s3cret-on-argv")
    assert code == 2 and "--api-key-file" in err and "s3cret" not in err
    # A bad reset option, over the official client.
    with masenvs_server("say") as url:
        with pytest.raises(RuntimeError, match="seed must be a non-negative integer"):
            run(play(url, -1, []))
        with pytest.raises(RuntimeError, match="unknown reset option.*'colour'"):
            run(play(url, 0, [], colour="red"))


def test_state_and_observations_hold_nothing_hidden() -> None:
    from masenvs.registry import make

    secrets = {}
    code = make("code")
    code.reset(seed=0)
    hidden = [t for t in code.task.tests if t not in code.task.public_tests]
    secrets["code"] = [
        line.strip() for line in code.task.reference_solution.splitlines()[1:] if line.strip()
    ] + [json.dumps(t.input) for t in hidden]
    verilog = make("verilog")
    verilog.reset(seed=0)
    secrets["verilog"] = [
        line.strip() for line in verilog.task.golden.splitlines()[1:] if len(line.strip()) > 8
    ]
    for env, hidden_text in secrets.items():
        with masenvs_server(env) as url:
            seen = run(play(url, 0, ["hello", "again"]))
        shown = json.dumps(seen)
        assert hidden_text and not [s for s in hidden_text if s in shown], env
        assert set(seen["state"]) <= {
            "episode_id",
            "step_count",
            "env",
            "round",
            "acting",
            "done",
            "success",
            "returns",
        }


def test_sessions_are_capped_and_idle_ones_expire() -> None:
    async def scenario(url: str) -> None:
        clients = [GenericEnvClient(base_url=url) for _ in range(2)]
        for client in clients:
            await client.reset(seed=0)
        # A third session is refused at once, with the protocol's error, before any request.
        async with ws_connect(url.replace("http", "ws") + "/ws") as ws:
            refused = json.loads(await ws.recv())
        assert refused["data"]["code"] == "CAPACITY_REACHED"
        await asyncio.sleep(2.5)  # both sessions idle past the timeout: closed by the server
        with pytest.raises(Exception):  # noqa: B017 - the server closed the connection
            await clients[0].step({"message": "Yes"})
        fresh = GenericEnvClient(base_url=url)
        assert not (await fresh.reset(seed=0)).done  # their slots are free again
        await fresh.close()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()

    with masenvs_server("say", max_sessions=2, idle_timeout=1.0) as url:
        run(scenario(url))


def test_a_key_is_required_beyond_loopback() -> None:
    key = "s3cret-key-for-tests"
    with masenvs_server("say", options={"task": "fixed"}, api_key=key) as url:
        with pytest.raises(ConnectionError):
            run(play(url, 0, ["Yes"]))
        assert httpx.get(f"{url}/health").status_code == 401
        with_key = url.replace("http://", f"http://masenvs:{key}@")  # the official client, as is
        assert run(play(with_key, 0, ["Yes"]))["rewards"] == [1.0]
        bearer = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/health", headers=bearer).status_code == 200


# --- the command and the docs ------------------------------------------------------------------


@contextlib.contextmanager
def cli_server(*args: str) -> Iterator[tuple[str, int]]:
    """`masenvs openenv-serve ARGS` in a subprocess: its URL (from the first line it prints)
    and its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "masenvs", "openenv-serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"at (http://\S+)", line)
        assert match, line + proc.stdout.read()
        # Drain what it prints later, so a full pipe never blocks the server.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield match.group(1), proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_command_stays_up_with_bounded_memory_under_100_hostile_sessions() -> None:
    """100 sessions at once, each sending a body that would parse into 300,000 dicts (3 bytes
    each on the wire, ~64 bytes once parsed), a message over the size limit and a frame far
    over it, then playing on: every one gets its errors, the server's memory barely moves."""
    bomb = "[" + "{}," * 300_000 + "{}]"

    async def hostile(url: str, seed: int) -> float:
        async with ws_connect(url.replace("http", "ws") + "/ws", max_size=None) as ws:
            await ws.send(bomb)
            assert json.loads(await ws.recv())["data"]["code"] == "VALIDATION_ERROR"
            await ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await asyncio.sleep(0.2)  # all 100 open at once
            await ws.send(json.dumps({"type": "step", "data": {"message": "x" * 1_100_000}}))
            assert json.loads(await ws.recv())["type"] == "error"
            await ws.send(json.dumps({"type": "step", "data": {"message": "Yes"}}))
            return json.loads(await ws.recv())["data"]["reward"]

    async def all_of(url: str) -> list[float]:
        return await asyncio.gather(*(hostile(url, seed) for seed in range(100)))

    with cli_server("say", "--set", "task=fixed", "--max-sessions", "128") as (url, pid):
        run(play(url, 0, ["Yes"]))  # warm: the env's modules are loaded
        before = rss_mib(pid)
        rewards = run(all_of(url))
        assert run(oversized(url)) == 1009
        after = rss_mib(pid)
        again = run(all_of(url))
        after_again = rss_mib(pid)
        assert rewards == again == [1.0] * 100  # every session still played its own episode
        assert httpx.get(f"{url}/health").json()["status"] == "healthy"
    # Parsed, the bombs alone would be 100 x 300,000 dicts, about 2 GB. What is in flight is the
    # raw messages (100 sessions x up to 1.1 MB); the command fixes glibc's mmap threshold so
    # each has its own mapping and goes back when freed: +13 MB after the first wave, +5 MB
    # after the second (measured, also beside 3 busy processes). With glibc's defaults a wave
    # left 75-170 MB, and a second wave up to 140 MB more (the CI run of stop 48).
    assert after - before < 100, (before, after)
    assert after_again - after < 40, (after, after_again)


def test_the_command_serves_an_env(tmp_path: Path) -> None:
    with cli_server("sudoku", "--set", "size=4") as (url, _):
        got = run(play(url, 5, ["hello"]))
    want = local("sudoku", 5, ["hello"], options={"size": 4})
    assert got["observations"][0]["prompt"] == want["prompts"][0]
    assert got["rewards"] == want["rewards"]


def python_blocks() -> list[str]:
    """The python examples of docs/integrations.md's OpenEnv section."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text.split("## OpenEnv\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.timeout(120)  # two fresh interpreters import openenv-core (seconds each)
def test_docs_example_runs(tmp_path: Path) -> None:
    client_example = python_blocks()[0]
    with cli_server("plan_path") as (url, _):
        script = tmp_path / "example.py"
        script.write_text(client_example.replace("http://127.0.0.1:8000", url))
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=40
        )
    assert done.returncode == 0, done.stderr
    assert "reward" in done.stdout


# Importing TRL alone takes 7 s of CPU, and 25 s of wall time on a loaded box: a margin.
@pytest.mark.timeout(120)
def test_trl_trains_on_the_server_as_the_docs_say(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    (example,) = [b for b in python_blocks() if "GRPOTrainer" in b]
    swaps = {
        'load_model("smollm2-135m")': 'load_model("tiny")',
        '"runs/trl-openenv"': repr(str(tmp_path / "out")),
        "max_steps=100": "max_steps=2, use_cpu=True, save_strategy='no'",
        "per_device_train_batch_size=8": "per_device_train_batch_size=2",
        "num_generations=4": "num_generations=2",
        "max_completion_length=512": "max_completion_length=16",
        "rows = 400": "rows = 4",
    }
    with masenvs_server("plan_path", options={"size": 4}) as url:
        swaps['"http://127.0.0.1:8000"'] = repr(url)
        for old, new in swaps.items():
            assert old in example, f"the docs example no longer has {old!r}"
            example = example.replace(old, new)
        scope: dict[str, Any] = {}
        exec(example, scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "rewards/PlanPath/mean" in h]
    assert len(logged) == 2  # the env's reward, read back from the server, reached TRL


# --- the other way round: an OpenEnv env trained by `masenvs train` ----------------------------------


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class SayYes(Environment[WordAction, WordObservation, State]):
    """An env written for OpenEnv: say a word (drawn from the seed); reward 1 when you do."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    WORDS = ("Yes", "No", "Maybe")

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.word = "Yes"

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> WordObservation:
        self.word = self.WORDS[(seed or 0) % len(self.WORDS)]
        self._state = State(episode_id=episode_id or "e", step_count=0)
        return WordObservation(prompt=f"Say {self.word}.")

    def step(self, action: WordAction, timeout_s: float | None = None, **_: Any) -> WordObservation:
        self._state.step_count += 1
        hit = action.message.strip().startswith(self.word)
        return WordObservation(prompt="Right." if hit else "Wrong.", reward=float(hit), done=True)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture
def openenv_url() -> Iterator[str]:
    app = create_app(SayYes, WordAction, WordObservation, max_concurrent_envs=64)
    with running(app) as url:
        yield url


@pytest.fixture
def registered() -> str:
    # the registry names it without an import, and keeps it out of the task envs
    assert "openenv" in list_bridges() and "openenv" not in list_envs()
    return "openenv"


def test_an_openenv_env_is_a_masenvs_env(openenv_url: str, registered: str) -> None:
    from pettingzoo.test import parallel_api_test

    from masenvs.registry import make

    env = make(registered, url=openenv_url, team=["coach", "player"], observation_field="prompt")
    assert env.possible_agents == ["coach", "player"]
    obs, infos = env.reset(seed=1)
    assert "Say No." in obs["coach"] and "Say No." in obs["player"]
    _, rewards, terms, _, infos = env.step({"coach": "Say No, nothing else."})
    assert rewards == {"coach": 0.0, "player": 0.0} and not any(terms.values())
    assert "Say No, nothing else." in obs_of(env, "player")  # the player reads its coach
    snap = env.snapshot()
    _, rewards, terms, _, infos = env.step({"player": "No"})
    assert rewards == {"coach": 1.0, "player": 1.0} and all(terms.values())  # the team reward
    assert infos["player"]["success"]
    env.restore(snap)  # branching replays the OpenEnv episode to the snapshot
    _, rewards, _, _, _ = env.step({"player": "Yes"})
    assert rewards == {"coach": 0.0, "player": 0.0}
    env.close()
    parallel_api_test(make(registered, url=openenv_url, observation_field="prompt"), num_cycles=3)


def test_concurrent_openenv_envs_leave_no_proxy_setting_behind(
    openenv_url: str, registered: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # openenv-core's connect sets NO_PROXY for a loopback URL and puts back what it found:
    # connects interleaved on one loop used to leave it set for good, and every later child
    # process (and langchain-openai, which then warns on stderr) saw a proxy setting.
    from concurrent.futures import ThreadPoolExecutor

    from masenvs.registry import make

    monkeypatch.delenv("NO_PROXY", raising=False)
    envs = [make(registered, url=openenv_url, observation_field="prompt") for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda env: env.reset(seed=0), envs))
    for env in envs:
        env.close()
    assert "NO_PROXY" not in os.environ


def obs_of(env: Any, agent: str) -> str:
    return env.observe(agent)


def test_masenvs_train_trains_an_openenv_env_as_a_role_of_a_team(
    openenv_url: str, registered: str, tmp_path: Path
) -> None:
    from masenvs.trainer.run.metrics import read_metrics

    (example,) = [b for b in python_blocks() if "env.name=openenv" in b]
    run_dir = tmp_path / "run"
    swaps = {"http://127.0.0.1:8001": openenv_url, "runs/openenv-team": str(run_dir)}
    for old, new in swaps.items():
        assert old in example, f"the docs example no longer has {old!r}"
        example = example.replace(old, new)
    exec(example, {})
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/success" in r]
    assert len(records) == 2
    # Both roles of the team were sampled and trained with AT-GRPO on the OpenEnv env's reward.
    assert {"train/reward/coach", "train/reward/player"} <= set(records[-1])
