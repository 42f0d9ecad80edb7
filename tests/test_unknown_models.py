"""One default everywhere: a model name that is no agent, route or loaded model is a 404
naming the known models (`serve`, `rollout`, `rollout --workflow`, as `train` does), unless
`--unknown-agents base` is asked for. The serve banner's snippet asks for the adapter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from masenvs.adapters.rollout import main as rollout_main
from masenvs.traces import TraceStore

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """`masenvs serve --model tiny` with the test's extra flags: (base URL, banner)."""
    extra = getattr(request, "param", [])
    command = [sys.executable, "-m", "masenvs", "serve", "--model", "tiny", "--port", "0"]
    server = subprocess.Popen(
        [*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # The start-up lines (loading, warmed ...) come first, then the 9-line banner.
        first = next(line for line in server.stdout if " at http://" in line)  # type: ignore[union-attr]
        lines = [first, *(server.stdout.readline() for _ in range(8))]  # type: ignore[union-attr]
        url = lines[0].split(" at ")[-1].strip()
        assert url.endswith("/v1"), lines
        yield url, "".join(lines)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serve_answers_an_unknown_model_with_404_naming_the_known_ones(
    served: tuple[str, str],
) -> None:
    url, _ = served
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        api.chat.completions.create(model="solvr", messages=HELLO, max_tokens=2)
    message = caught.value.body["message"]  # type: ignore[index]
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "'solvr' does not exist" in message and "(tiny)" in message
    assert "--unknown-agents base" in message
    api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)  # the base model


@pytest.mark.parametrize("served", [["--unknown-agents", "base"]], indirect=True)
def test_serve_unknown_agents_base_answers_any_name(served: tuple[str, str]) -> None:
    url, _ = served
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    reply = api.chat.completions.create(model="solvr", messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("served", [["--route", "solver=base"]], indirect=True)
def test_the_banner_snippet_asks_for_the_served_agent(served: tuple[str, str]) -> None:
    _, banner = served
    assert "client.chat.completions.create(model='solver'" in banner, banner


WORKFLOW = [
    "--env",
    "math",
    "--set",
    "level=1",
    "--model",
    "tiny",
    "--episodes",
    "1",
    "--max-tokens",
    "4",
    "--workflow",
    "workflow_programs:langgraph_own_critic",  # its critic asks for model 'critic_v2'
    "--framework",
    "langgraph",
    "--agents",
    "solver",
]


def test_rollout_workflow_refuses_an_unknown_model_by_default(tmp_path: Path) -> None:
    assert rollout_main([*WORKFLOW, "--traces", str(tmp_path)]) == 1  # a run failed
    (episode,) = TraceStore(tmp_path).episodes()
    error = episode.extra["error"]
    assert error is not None and "404" in error and "critic_v2" in error and "(solver)" in error
    assert {c.agent for c in TraceStore(tmp_path).calls()} == {"solver"}


def test_rollout_workflow_serves_unknown_models_with_base_when_asked(tmp_path: Path) -> None:
    argv = [*WORKFLOW, "--traces", str(tmp_path), "--unknown-agents", "base"]
    assert rollout_main(argv) == 0
    (episode,) = TraceStore(tmp_path).episodes()
    assert episode.extra["error"] is None
    assert {c.agent for c in TraceStore(tmp_path).calls()} == {"solver", "critic_v2"}


def test_rollout_serves_the_envs_own_agents_and_refuses_others(tmp_path: Path) -> None:
    from masenvs.adapters.rollout import build_parser, rollout_policy_map

    args = build_parser().parse_args(["--env", "plan_path"])
    policy_map = rollout_policy_map(args, None, {})
    assert policy_map.resolve("tool", ["tiny"]) == "base"
    assert policy_map.resolve("plan", ["tiny"]) == "base"
    with pytest.raises(LookupError, match=r"'planner' does not exist.*\(plan, tool\)"):
        policy_map.resolve("planner", ["tiny"])
