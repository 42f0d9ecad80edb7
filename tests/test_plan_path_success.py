"""What success means in plan-path: moves after G are ignored by default, so an overshooting
plan succeeds; `exact_stop` and `optimal` say how many successes were clean, in the env's info,
in the trainer's train/ and val/ metrics and in `masenvs eval`; `strict_success` fails them."""

from __future__ import annotations

import asyncio
import json
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console
from tiny_runs import plan_path_run

import masenvs
from masenvs.adapters.episodes import EpisodeResult
from masenvs.adapters.policy import Reply
from masenvs.trainer.config import load_config
from masenvs.trainer.evaluate import EvalTask, Target, evaluate, results_table
from masenvs.trainer.rollout.sources import rollout_metrics, validation_metrics
from masenvs.trainer.rollout.tree import TaskRollout
from masenvs.trainer.run.train import train

# Optimal path: R, R, R (3 moves).
TASK = {"rows": ["....", ".##.", "....", "...."], "start": [0, 0], "goal": [0, 3]}


def play(*answers: str, **options) -> tuple[masenvs.MASEnv, dict]:
    """Plan-path alone on TASK, one answer a round; the env and the last step's info."""
    env = masenvs.make("plan_path", single_agent=True, **options)
    env.reset(seed=0, options={"task": TASK})
    for answer in answers:
        *_, infos = env.step({"plan": answer})
    return env, infos["plan"]


def test_an_overshooting_plan_succeeds_but_does_not_stop_at_the_goal() -> None:
    env, info = play("#### [R, R, R, D, L]")
    assert info["success"] and env.state.pos == (0, 3)  # moves after G ignored (default)
    assert info["reward_parts"]["team"] == pytest.approx(1.5)  # the path to G is optimal
    assert info["metrics"] == {"optimal": 0.0, "exact_stop": 0.0}
    assert env.episode_metrics() == info["metrics"]


def test_a_shortest_plan_that_stops_on_the_goal_is_optimal() -> None:
    assert play("#### [R, R, R]")[1]["metrics"] == {"optimal": 1.0, "exact_stop": 1.0}
    # Over two rounds the path is still 3 moves.
    assert play("#### [R]", "#### [R, R]")[1]["metrics"] == {"optimal": 1.0, "exact_stop": 1.0}
    # A detour that stops on G: exact, not optimal.
    detour = play("#### [D, D, R, R, R, U, U]")[1]
    assert detour["success"] and detour["metrics"] == {"optimal": 0.0, "exact_stop": 1.0}
    # An invalid move does not move A: the path is still R, R, R (as the optimal bonus counts).
    assert play("#### [U, R, R, R]")[1]["metrics"] == {"optimal": 1.0, "exact_stop": 1.0}
    # No goal: neither.
    missed = play("#### [D]", max_rounds=1)[1]
    assert not missed["success"] and missed["metrics"] == {"optimal": 0.0, "exact_stop": 0.0}


def test_walking_every_move_through_the_goal_and_back_is_not_an_exact_stop() -> None:
    env, info = play("#### [R, R, R, D, U]", stop_at_goal=False)
    assert info["success"] and env.state.pos == (0, 3)  # it ends on G
    assert info["metrics"] == {"optimal": 0.0, "exact_stop": 0.0}


def test_strict_success_fails_a_plan_that_goes_past_the_goal() -> None:
    env, info = play("#### [R, R, R, D, L]", strict_success=True)
    assert not info["success"] and env.state.failed and not env.agents  # the episode ends
    assert info["reward_parts"]["team"] == 0.0  # no goal bonus, no optimal bonus
    assert info["metrics"] == {"optimal": 0.0, "exact_stop": 0.0}
    assert "past the goal" in env.last_feedback["plan"]
    env, info = play("#### [R, R, R]", strict_success=True)
    assert info["success"] and info["reward_parts"]["team"] == pytest.approx(1.5)
    env, info = play("#### [R, R, R, D, U]", strict_success=True, stop_at_goal=False)
    assert not info["success"] and env.state.failed


def test_strict_success_scores_the_tools_proposal_the_same_way() -> None:
    env = masenvs.make("plan_path", tool_task="propose", strict_success=True)
    env.reset(seed=0, options={"task": TASK})
    *_, infos = env.step({"tool": "#### [R, R, R, D]"})
    assert infos["tool"]["reward_parts"]["agent"] == 0.0
    env.reset(seed=0, options={"task": TASK})
    *_, infos = env.step({"tool": "#### [R, R, R]"})
    assert infos["tool"]["reward_parts"]["agent"] == pytest.approx(1.5)


def test_rates_are_averaged_beside_success() -> None:
    def rollout(success: bool, optimal: float, exact: float) -> TaskRollout:
        metrics = {"optimal": optimal, "exact_stop": exact}
        return TaskRollout("plan_path:0", 0, success=success, rounds=1, metrics=metrics)

    train_metrics = rollout_metrics(
        [rollout(True, 1.0, 1.0), rollout(True, 0.0, 0.0), rollout(True, 0.0, 1.0),
         rollout(False, 0.0, 0.0)]
    )  # fmt: skip
    assert train_metrics["train/success"] == 0.75
    assert train_metrics["train/exact_stop"] == 0.5 and train_metrics["train/optimal"] == 0.25

    def episode(success: bool, metrics: dict, error: str | None = None) -> EpisodeResult:
        return EpisodeResult("v", "plan_path", 0, success, 1, {}, 1, 0.1, error, metrics=metrics)

    val = validation_metrics(
        [episode(True, {"optimal": 0.0, "exact_stop": 1.0}), episode(False, {}, "timeout")]
    )
    assert val["val/success"] == 0.5 and val["val/exact_stop"] == 0.5
    assert val["val/optimal"] == 0.0  # an episode cut short counts as neither


def test_a_training_run_reports_the_rates_in_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = ["model.name=tiny", "steps=1", "validation.every=1", "validation.episodes=2"]
    train(load_config(None, plan_path_run(run_dir, *overrides)), console=Console(file=StringIO()))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_line = next(m for m in lines if "train/success" in m)
    val_line = next(m for m in lines if "val/success" in m)
    for line, kind in ((train_line, "train"), (val_line, "val")):
        optimal, exact = line[f"{kind}/optimal"], line[f"{kind}/exact_stop"]
        assert 0.0 <= optimal <= exact <= line[f"{kind}/success"] <= 1.0


class Scripted:
    """A policy that gives the plan agent the same answer every time."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    async def act(self, rollout_id: str, agent: str, messages: list, **_) -> list[Reply]:
        return [Reply(self.answer, 5, "stop")]


def test_eval_reports_the_rates_beside_avg() -> None:
    tasks = [EvalTask("t", 0, {"task": TASK})]
    options = {"single_agent": True}
    results = [
        asyncio.run(evaluate(Target(name, Scripted(answer)), "plan_path", options, tasks, n=2, k=1))
        for name, answer in (("clean", "#### [R, R, R]"), ("overshoot", "#### [R, R, R, D]"))
    ]
    assert [(r.avg, r.metrics) for r in results] == [
        (1.0, {"optimal": 1.0, "exact_stop": 1.0}),
        (1.0, {"optimal": 0.0, "exact_stop": 0.0}),
    ]
    printed = StringIO()
    Console(file=printed, width=200).print(results_table(results, "plan_path"))
    header = printed.getvalue()
    assert "optimal" in header and "exact stop" in header and "100.0%" in header


def test_workflow_runs_report_the_rates_too() -> None:
    from masenvs.adapters.frameworks.workflow import WorkflowRun
    from masenvs.trainer.rollout.workflow import workflow_metrics

    def run(success: bool, metrics: dict, error: str | None = None) -> WorkflowRun:
        return WorkflowRun("r", "plan_path:0", 0, 0, 1.0, success, "", error, 0.1, 0.0,
                           metrics=metrics)  # fmt: skip

    clean, overshoot = {"optimal": 1.0, "exact_stop": 1.0}, {"optimal": 0.0, "exact_stop": 0.0}
    metrics = workflow_metrics([run(True, clean), run(True, overshoot), run(False, {}, "boom")], [])
    assert metrics["train/success"] == pytest.approx(2 / 3)
    assert metrics["train/exact_stop"] == pytest.approx(1 / 3)
    assert metrics["train/optimal"] == pytest.approx(1 / 3)


def test_a_workflow_training_run_reports_the_rates_in_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "model.name=tiny",
        "steps=1",
        "rollout.max_tokens=6",
        "validation.every=1",
        "validation.episodes=1",
        "workflow.factory=framework_programs:langgraph_pair",
        "workflow.framework=langgraph",
        "workflow.agents=[solver, checker]",
    ]
    train(load_config(None, plan_path_run(run_dir, *overrides)), console=Console(file=StringIO()))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for kind in ("train", "val"):
        line = next(m for m in lines if f"{kind}/success" in m)
        assert 0.0 <= line[f"{kind}/optimal"] <= line[f"{kind}/exact_stop"] <= 1.0
