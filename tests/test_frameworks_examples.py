"""The shipped examples run end to end on CPU through the one training loop: K runs per task,
then one training step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from masenvs.traces import TraceStore
from masenvs.trainer.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "langgraph_math.py": ["solver", "verifier"],
    "autogen_code.py": ["coder", "reviewer"],
    "llamaindex_plan_path.py": ["navigator", "reviewer"],
}


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_runs_and_takes_a_training_step(tmp_path, script) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(ROOT / "examples" / script),
        *("--model", "tiny", "--tasks-per-step", "2", "--branches", "2", "--train-steps", "1"),
        *("--max-tokens", "16", "--run-dir", str(run_dir)),
    ]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 1/1" in done.stdout, done.stdout  # the training loop's step line
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["step"] == 1 and row["train/failed_runs"] == 0 and row["groups/groups"] > 0
    store = TraceStore(run_dir / "traces")
    calls = list(store.calls())
    episodes = list(store.episodes())
    assert len(episodes) == 4 and all(e.extra["error"] is None for e in episodes)
    agents = EXAMPLES[script]
    assert calls and {c.agent for c in calls} <= set(agents)
    assert all(c.model == c.agent for c in calls)  # per-agent adapters served every call
    assert all(c.rollout_id in {e.rollout_id for e in episodes} for c in calls)
