"""Long work is never silent: `masenvs train`, `rollout` and `eval`, run as a user runs them
with their output going to a log (not a terminal), print each phase's first line as the
phase starts, with an ETA once there is one, and no third-party progress bars."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MASENVS = [sys.executable, "-m", "masenvs"]
BARS = ("it/s]", "%|", "Loading checkpoint shards", "Converting and de-quantizing")


def log_of(*args: str, cwd: Path, code: int = 0) -> list[str]:
    """The non-empty lines of stdout + stderr, piped as into a log file; exit status `code`.
    The test programs (tests/framework_programs.py) import as a user's would."""
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("MASENVS_VERBOSE", None)
    done = subprocess.run(
        [*MASENVS, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == code, "\n".join(lines)
    return lines


def index(lines: list[str], *parts: str, after: int = -1) -> int:
    """The first line after line `after` holding every one of `parts`."""
    for i, line in enumerate(lines):
        if i > after and all(p in line for p in parts):
            return i
    raise AssertionError(f"no line with {parts} after line {after}:\n" + "\n".join(lines))


def test_a_training_run_in_a_log_names_each_phase_as_it_starts(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("{}\n")
    settings = [
        f"run_dir={tmp_path / 'run'}",
        "model.name=tiny",
        "lora.rank=4",
        "steps=2",
        "env.name=plan_path",
        "rollout.branches=2",
        "rollout.tasks_per_step=1",
        "rollout.max_tokens=8",
        "validation.every=2",
        "validation.episodes=1",
        "optim.warmup_steps=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
    ]
    lines = log_of("train", "empty.yaml", *(f"--set={s}" for s in settings), cwd=tmp_path)
    # Each phase's line comes as it starts (timestamped), in the order the run goes.
    at = index(lines, "loading tiny for the learner")
    at = index(lines, "validating before training", after=at)
    at = index(lines, "episode 1/1", "ETA", after=at)  # validation's episodes, with an ETA
    at = index(lines, "step 0 validation: success", after=at)
    at = index(lines, "step 1/2 rollout:", after=at)
    at = index(lines, "step 1/2 update:", after=at)
    at = index(lines, "step 1/2  success", "run ETA", after=at)  # the run's ETA
    at = index(lines, "step 2/2 rollout:", "ETA", "run ETA", after=at)
    assert "0 calls" not in lines[at], lines[at]  # nothing done yet: no row of zeros
    at = index(lines, "step 2 validation", after=at)
    index(lines, "step 2/2  success", "val success", after=at)
    for bar in BARS:
        assert not any(bar in line for line in lines), bar


def test_rollout_and_eval_say_what_they_load_before_it_is_loaded(tmp_path: Path) -> None:
    lines = log_of(
        "rollout", "--env", "plan_path", "--model", "tiny", "--episodes", "1",
        "--max-tokens", "8", "--traces", str(tmp_path / "traces"), cwd=tmp_path,
    )  # fmt: skip
    at = index(lines, "loading tiny")
    at = index(lines, "1 episodes of plan_path", after=at)
    index(lines, "episode 1/1", "ETA", after=at)
    lines = log_of(
        "eval", "--env", "plan_path", "--model", "tiny", "--tasks", "2", "-k", "1",
        "--max-tokens", "8", "--out", str(tmp_path / "eval.json"), cwd=tmp_path,
    )  # fmt: skip
    at = index(lines, "loading tiny")
    at = index(lines, "base", "2 tasks x 1 episodes", after=at)  # each policy's first line
    index(lines, "episodes 2/2", "ETA", after=at)
    for bar in BARS:
        assert not any(bar in line for line in lines), bar


def test_a_workflow_rollout_past_its_timeout_names_the_flag_to_raise_once(
    tmp_path: Path,
) -> None:
    lines = log_of(
        "rollout", "--env", "math", "--set", "level=1", "--model", "tiny", "--episodes", "1",
        "--max-tokens", "8", "--traces", str(tmp_path / "traces"),
        "--workflow", "framework_programs:calls_then_sleeps", "--framework", "langgraph",
        "--agents", "solver", "--timeout-s", "1",
        cwd=tmp_path, code=1,  # every run failed
    )  # fmt: skip
    index(lines, "loading tiny")
    fixes = [line for line in lines if "raise --timeout-s" in line]
    assert len(fixes) == 1 and "1 run(s) ran past --timeout-s=1" in fixes[0], lines


def test_third_party_bars_are_quiet_while_a_model_loads_unless_verbose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from masenvs.engine.loading import VERBOSE_ENV, quiet_progress_bars

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    before = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    with quiet_progress_bars():
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    assert (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before
    monkeypatch.setenv(VERBOSE_ENV, "1")  # `masenvs train --verbose`
    with quiet_progress_bars():
        assert hf_logging.is_progress_bar_enabled() == before[0]
