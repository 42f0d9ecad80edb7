"""An existing LangGraph agent with a state of its own trains unchanged: `masenvs train` as a
user runs it (a subprocess in the agent's project, no PYTHONPATH), the task mapped to the
graph's keys in the config. Without the mapping it fails in one line, before any model loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from masenvs.adapters.frameworks.langgraph import GraphInputError, check_input, graph_input
from masenvs.traces import TraceStore

AGENT = Path(__file__).parent / "data" / "reviewer_agent"
MASENVS = str(Path(sys.executable).parent / "masenvs")


def project(tmp_path: Path, **workflow: Any) -> Path:
    """The user's folder: the agent's code in agent/ and a training config beside it."""
    shutil.copytree(AGENT, tmp_path / "agent")
    config = {
        "run_dir": "runs/review",
        "steps": 2,
        "model": {"name": "tiny"},
        "lora": {"rank": 4, "alpha": 8},
        "env": {"name": "math", "options": {"level": 1}},
        "rollout": {"branches": 2, "tasks_per_step": 1, "max_tokens": 8},
        "validation": {"every": 0},
        "logging": {"tensorboard": False, "plot_every": 0},
        "workflow": {
            "factory": "agent/factory.py:make",
            "framework": "langgraph",
            "agents": ["writer", "critic"],
            **workflow,
        },
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def masenvs(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["COLUMNS"] = "400"  # one line per message, as in a log
    return subprocess.run(
        [MASENVS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_graph_with_its_own_state_trains_with_the_mapping_in_the_config(tmp_path: Path) -> None:
    root = project(tmp_path, input={"question": "{task}", "tries": 0}, answer_from="draft")
    done = masenvs(root, "train", "train.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    run = root / "runs" / "review"
    assert (run / "checkpoints" / "step_00000002").is_dir()
    store = TraceStore(run / "traces")
    calls = list(store.calls())
    assert {c.agent for c in calls} == {"writer", "critic"}
    for episode in store.episodes():
        assert episode.extra["error"] is None, episode.extra["error_detail"]
        mine = [c for c in calls if c.rollout_id == episode.rollout_id]
        # write -> review -> write -> review: the question reached the graph, the answer is
        # the state key `draft`, i.e. the writer's last reply
        assert [c.agent for c in mine] == ["writer", "critic", "writer", "critic"]
        assert "Answer:" in mine[0].messages[-1]["content"]
        assert episode.extra["answer"] == mine[2].choices[0].text
    # The default warmup (10 steps) is longer than this 2-step run, and it says so.
    assert "optim.warmup_steps=10 is longer than the run (steps=2)" in done.stdout
    assert "adapters moved from their start" in done.stdout


def test_without_the_mapping_it_fails_in_one_line_naming_what_masenvs_passed(
    tmp_path: Path,
) -> None:
    root = project(tmp_path)
    done = masenvs(root, "train", "train.yaml", timeout=120)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "masenvs passed {'messages': <the task as chat messages>}" in lines[0]
    assert "(keys: question, draft, verdict, tries)" in lines[0]
    assert "workflow.input: {question: '{task}'}" in lines[0]
    assert not (root / "runs").exists()  # checked before any model loaded or run began


def test_the_factory_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / "agent" / "reviewer_graph.py").unlink()  # the sibling module is gone
    done = masenvs(root, "train", "train.yaml", timeout=120)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [lines[0]] and "Traceback" not in lines[0]
    assert "importing agent/factory.py failed" in lines[0]
    assert "ModuleNotFoundError: No module named 'reviewer_graph'" in lines[0]


def test_input_templates_fill_the_task_and_keep_constants() -> None:
    messages = [{"role": "user", "content": "2+2?"}]
    mapping = {"question": "Q: {task} ({env} #{seed})", "tries": 0, "history": "{messages}"}
    fields = {"task": "2+2?", "env": "math", "seed": 3}
    assert graph_input(messages, mapping, fields) == {
        "question": "Q: 2+2? (math #3)",
        "tries": 0,
        "history": messages,
    }
    assert graph_input(messages, None) == {"messages": messages}
    with pytest.raises(GraphInputError, match=r"\{task\}, \{env\} or \{seed\}"):
        graph_input(messages, {"question": "{taks}"}, fields)


def test_a_messages_graph_needs_no_mapping_and_a_wrong_key_is_named() -> None:
    from langgraph.graph import START, MessagesState, StateGraph

    graph = StateGraph(MessagesState)
    graph.add_node("noop", lambda state: {})
    graph.add_edge(START, "noop")
    compiled = graph.compile()
    check_input(compiled, None)  # the default input fits MessagesState
    with pytest.raises(GraphInputError, match="has no key 'question'"):
        check_input(compiled, {"question": "{task}"})
