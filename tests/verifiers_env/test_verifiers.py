"""masenvs and Prime Intellect's verifiers (0.4), both ways, with the real libraries.

masenvs -> verifiers: verifiers' own eval loop (`run_eval`, what `vf-eval` runs) plays masenvs
episodes against a real `masenvs serve` on loopback; the trace's reward is what the masenvs env
pays when the transcript is replayed through it. verifiers -> masenvs: a taskset written for
verifiers (tests/verifiers_env/vf_say_taskset.py) is a masenvs env that `masenvs train` trains with AT-GRPO.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import verifiers.v1 as vf
from verifiers.v1.cli.eval.runner import run_eval
from verifiers.v1.configs.cli.eval import EvalConfig

import masenvs
from masenvs.integrations import verifiers as masenvs_vf
from masenvs.integrations.episode import TextEpisode
from masenvs.integrations.from_verifiers import VerifiersEnv

ROOT = Path(__file__).resolve().parents[2]
TASKSET = masenvs_vf.TASKSET_ID


# --- a real `masenvs serve` on loopback --------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`masenvs serve --model tiny` on a free loopback port; its base URL (`.../v1`)."""
    args = [sys.executable, "-m", "masenvs.cli", "serve", "--model", "tiny", "--port", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        url = None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
            url = found.group(1) if found else None
        assert url, "masenvs serve did not start:\n" + "".join(lines)
        # keep reading its output so a full pipe never blocks the server
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def base_model(url: str) -> str:
    return httpx.get(f"{url}/models").json()["data"][0]["id"]


def evaluate(
    out: Path, url: str, taskset: dict[str, Any], env: dict[str, Any] | None = None, n: int = 2
) -> list[vf.Episode]:
    """verifiers' eval loop over the first `n` tasks, against `url`."""
    config = EvalConfig.model_validate(
        {
            "env": {"taskset": {"id": TASKSET, **taskset}, **(env or {})},
            "model": base_model(url),
            "client": {"base_url": url, "api_key_var": "MASENVS_TEST_NO_KEY"},
            "sampling": {"temperature": 1.0, "max_tokens": 16},
            "select": {"limit": n},
            "push": False,
            "rich": None,
            "output_dir": out,
        }
    )
    return asyncio.run(run_eval(config))


def replay(env: str, options: dict[str, Any], seed: int, actions: list[list[str]]) -> TextEpisode:
    """The same episode played by masenvs alone: every (role, action) stepped in order."""
    episode = TextEpisode(env, options, role=None)
    episode.reset(seed=seed)
    for role, action in actions:
        assert episode.env.acting == role
        episode.step(action)
    return episode


# --- masenvs -> verifiers ----------------------------------------------------------------------


ENVS = [
    ("plan_path", {"size": 4, "max_rounds": 2}),
    ("sudoku", {"size": 4, "max_rounds": 1}),
    ("sokoban", {"max_rounds": 1}),
    ("math", {"max_rounds": 1}),
    ("code", {"max_rounds": 1}),
    ("say", {}),
]


@pytest.mark.parametrize(("name", "options"), ENVS, ids=[name for name, _ in ENVS])
def test_vf_eval_plays_every_role_and_pays_the_env_reward(
    served: str, tmp_path: Path, name: str, options: dict[str, Any]
) -> None:
    episodes = evaluate(tmp_path, served, {"env": name, "options": options})
    assert len(episodes) == 2
    for episode in episodes:
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        data = trace.task.data
        played = trace.info["masenvs"]["actions"]
        # one model call per env step, each role in turn order, through verifiers' interception
        roles = masenvs.make(name, **options).possible_agents
        assert [role for role, _ in played] == [roles[i % len(roles)] for i in range(len(played))]
        assert [m.content for m in trace.assistant_messages] == [a for _, a in played]
        mirror = replay(name, options, data.seed, played)
        assert mirror.done  # the whole episode was played
        assert trace.rewards["masenvs"].value == pytest.approx(mirror.reward)
        assert trace.reward == pytest.approx(sum(mirror.returns.values()))
        assert trace.info["masenvs"]["returns"] == pytest.approx(mirror.returns)
        for level, value in mirror.reward_parts.items():
            assert trace.metrics[f"reward/{level}"] == pytest.approx(value)
        # each call saw the acting role's prompt exactly as the env rendered it
        prompts = [b.messages[:-1] for b in trace.branches]
        mirror = TextEpisode(name, options)
        turn = mirror.reset(seed=data.seed)
        for prompt, (_, action) in zip(prompts, played, strict=True):
            assert [{"role": m.role, "content": m.content} for m in prompt] == turn.messages
            turn = mirror.step(action).next
    assert {e.traces[0].task.data.seed for e in episodes} == {0, 1}


def test_vf_eval_trains_one_role_with_the_others_behind_an_openai_url(
    served: str, tmp_path: Path
) -> None:
    options = {"size": 4, "max_rounds": 2}
    episodes = evaluate(
        tmp_path,
        served,
        {"env": "plan_path", "options": options, "role": "plan"},
        {"others": {"base_url": served, "model": base_model(served), "max_tokens": 16}},
        n=1,
    )
    (episode,) = episodes
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    played = trace.info["masenvs"]["actions"]
    ours = [a for role, a in played if role == "plan"]
    assert [role for role, _ in played][:2] == ["tool", "plan"]  # the fixed player moved first
    assert [m.content for m in trace.assistant_messages] == ours  # only plan's turns are ours
    mirror = replay("plan_path", options, trace.task.data.seed, played)
    assert trace.rewards["masenvs"].value == pytest.approx(mirror.returns["plan"])


def secrets(name: str, options: dict[str, Any]) -> list[str]:
    """What the env keeps from the policy for seed 0, as it would appear in JSON."""
    env = masenvs.make(name, **options)
    env.reset(seed=0)
    if name == "sudoku":
        grid = [list(row) for row in env.task.solution]
        return [json.dumps(grid), json.dumps(grid, separators=(",", ":")), "solution"]
    public = set(map(repr, env.task.public_tests))
    hidden = [t for t in env.hidden_tests() if repr(t) not in public]
    assert hidden
    found = [json.dumps(t.input)[1:-1] for t in hidden] + [json.dumps(t.output) for t in hidden]
    found += [json.dumps(env.task.reference_solution)[1:40], "reference_solution"]
    return [text for text in found if len(text) >= 8]  # shorter ones ('""', '"a"') are anywhere


@pytest.mark.parametrize(
    ("name", "options"), [("sudoku", {"size": 4, "max_rounds": 1}), ("code", {"max_rounds": 1})]
)
def test_no_hidden_data_in_the_tasks_or_the_traces(
    served: str, tmp_path: Path, name: str, options: dict[str, Any]
) -> None:
    taskset = {"env": name, "options": options}
    (episode,) = evaluate(tmp_path, served, taskset, n=1)
    assert episode.ok, episode.errors
    rows = [t.data.model_dump(exclude_none=True) for t in load_taskset(taskset).take(3)]
    assert {k for row in rows for k in row} <= PUBLIC_FIELDS
    written = [episode.model_dump_json(), *(p.read_text() for p in tmp_path.rglob("*.jsonl"))]
    for text in [json.dumps(rows), *written]:
        leaked = [secret for secret in secrets(name, options) if secret in text]
        assert not leaked


# what a task row holds: which episode to play, nothing of its answer
PUBLIC_FIELDS = {
    "idx",
    "name",
    "env",
    "options",
    "seed",
    "role",
    "network_allow",
    "skills",
    "network_block",
    "artifacts",
    "artifact_max_bytes",
    "timeout",
    "resources",
}


def load_taskset(taskset: dict[str, Any]) -> vf.Taskset:
    config = vf.resolve_env_config({"taskset": {"id": TASKSET, **taskset}})
    return vf.load_environment(config).taskset


@pytest.mark.parametrize(
    ("taskset", "env", "message"),
    [
        ({"env": "plan_pth"}, {}, "unknown environment 'plan_pth'; did you mean 'plan_path'?"),
        ({"env": "sudoku", "options": {"sizee": 4}}, {}, "unknown option 'sizee'"),
        ({"env": "plan_path", "role": "boss"}, {}, "'boss' is not one of them"),
        ({"env": "plan_path", "role": "plan"}, {}, "others.base_url"),
    ],
)
def test_bad_input_is_one_clear_error(
    taskset: dict[str, Any], env: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        config = vf.resolve_env_config({"taskset": {"id": TASKSET, **taskset}, **env})
        vf.load_environment(config)


@contextmanager
def scripted(reply: str) -> Iterator[str]:
    """An OpenAI-compatible chat server on loopback that answers every call with `reply`."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request: Any) -> JSONResponse:
        body = await request.json()
        message = {"role": "assistant", "content": reply}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        answer = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"]}
        return JSONResponse({**answer, "choices": [choice], "usage": usage})

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)]
    app = Starlette(routes=routes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_malformed_reply_is_the_env_invalid_move_with_its_penalty(tmp_path: Path) -> None:
    """Whatever the policy says reaches the env as it was said: no error, the env's penalty."""
    malformed = "  \x00{{{ not a move\n"
    options = {"size": 4, "max_rounds": 1}
    with scripted(malformed) as url:
        (episode,) = evaluate(tmp_path, url, {"env": "plan_path", "options": options}, n=1)
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.info["masenvs"]["actions"] == [["tool", malformed], ["plan", malformed]]
    mirror = replay("plan_path", options, 0, [["tool", malformed], ["plan", malformed]])
    assert mirror.reward < 0  # plan_path's format penalty, for each role
    assert trace.rewards["masenvs"].value == pytest.approx(mirror.reward)
    assert trace.info["masenvs"]["returns"] == pytest.approx(mirror.returns)


def docs_blocks(section: str) -> list[tuple[str, str]]:
    """The code blocks of docs/integrations.md's `## <section>`, as (language, code)."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", body, re.S)


def run_example(code: str, language: str, cwd: Path, url: str) -> None:
    """Run a docs block in `cwd` as a user would, against `url` (the docs say port 8000)."""
    assert base_model(url) == "tiny"  # the model the examples name
    code = code.replace("http://127.0.0.1:8000/v1", url)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(cwd)}
    args = ["bash", "-ec", code] if language == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_docs_verifiers_examples_run(served: str, tmp_path: Path) -> None:
    """vf-eval in both modes, the same from Python, a taskset written for verifiers trained
    by masenvs (docs/integrations.md, ## verifiers), each as a user copies it."""
    blocks = docs_blocks("verifiers")
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "python"]
    run_example(blocks[0][1], "bash", tmp_path, served)
    traces = list((tmp_path / "outputs").rglob("traces.jsonl"))
    assert len(traces) == 2  # one run per mode
    for path in traces:
        for line in path.read_text().splitlines():
            episode = json.loads(line)  # one episode a line, its traces inside
            assert episode["ok"] and "masenvs" in episode["traces"][0]["rewards"]
    run_example(blocks[1][1], "python", tmp_path, served)
    (tmp_path / "say_taskset.py").write_text(blocks[2][1])
    run_example(blocks[3][1], "python", tmp_path, served)
    records = [
        json.loads(x) for x in (tmp_path / "runs/say/metrics.jsonl").read_text().splitlines()
    ]
    assert sum("train/reward/solver" in r for r in records) == 2


# --- verifiers -> masenvs ----------------------------------------------------------------------


def test_a_verifiers_taskset_is_a_masenvs_env_paid_by_its_rubric() -> None:
    env = VerifiersEnv(taskset="vf-say-taskset")
    observations, infos = env.reset(seed=0, options={"task": 0})
    assert "letter 'Y'" in observations["solver"]
    assert "Yes" not in json.dumps(infos)  # the answer stays with the rubric
    _, rewards, terms, _, infos = env.step({"solver": "Yes"})
    assert rewards["solver"] == 1.0 and terms["solver"] and infos["solver"]["success"]
    env.reset(seed=0, options={"task": 0})
    _, rewards, _, _, infos = env.step({"solver": "\x00 not a word {{"})
    assert rewards["solver"] == 0.0 and not infos["solver"]["success"]


def test_a_verifiers_taskset_passes_the_env_contract() -> None:
    from pettingzoo.test import parallel_api_test

    parallel_api_test(VerifiersEnv(taskset="vf-say-taskset"), num_cycles=3)


def test_the_taskset_config_reaches_the_taskset() -> None:
    env = VerifiersEnv(taskset="vf-say-taskset", taskset_options={"words": ["Maybe"]})
    observations, _ = env.reset(seed=3)
    assert "letter 'M' and has 5 letters" in observations["solver"]
    assert env.step({"solver": "Maybe"})[1]["solver"] == 1.0


def test_a_verifiers_taskset_with_bad_input_says_so() -> None:
    with pytest.raises(Exception, match="vf-no-such-taskset"):
        VerifiersEnv(taskset="vf-no-such-taskset")
    with pytest.raises(ValueError, match="reward 'file_written' needs a runtime"):
        VerifiersEnv(taskset="vf-runtime-taskset")
    with pytest.raises(Exception, match="words"):
        VerifiersEnv(taskset="vf-say-taskset", taskset_options={"words": "Yes"})
    with pytest.raises(Exception, match="unknown option 'tasket'"):
        masenvs.make("verifiers", tasket="vf-say-taskset")


def test_masenvs_train_trains_a_verifiers_taskset_with_atgrpo(tmp_path: Path) -> None:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    overrides = [
        f"run_dir={tmp_path}",
        "model.name=tiny",
        "env.name=verifiers",
        "env.options={taskset: vf-say-taskset}",
        "steps=2",
        "rollout.branches=2",
        "rollout.tasks_per_step=2",
        "rollout.max_rounds=1",
        "rollout.max_tokens=4",
        "validation.every=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        "backend.dtype=float32",
        "backend.max_batch_size=8",
    ]
    train(load_config(None, overrides))
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in records if "train/success" in r]
    assert len(steps) == 2
    assert all("train/reward/solver" in r for r in steps)
    assert (tmp_path / "adapters").exists() or any(tmp_path.rglob("adapter_model.safetensors"))
