"""Trajectory-level GRPO (`rollout.mode: trajectory`): K independent episodes per task, no
tree, grouped by (task, turn, agent) or (task, agent); the paper's "+GRPO" baselines.

The unit tests script the policy on the real plan-path env (as tests/test_tree_rollout.py
does); the training tests run one step of every env with the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_tree_rollout import TASK, ScriptedPolicy, program

import masenvs
from masenvs.traces import TraceStore
from masenvs.trainer.config import load_config
from masenvs.trainer.rollout.tree import TaskRollout, team_term_metrics, trajectory_rollout
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train


def episode(k: int, group_by: str) -> tuple[TaskRollout, ScriptedPolicy]:
    """Episode 0 solves the task in round 1 (tool finds the path, plan follows it);
    episode 1 never does (no program, no plan) and ends after 2 rounds."""

    def script(agent: str, round_: int, n: int) -> list[str]:
        if k == 0:
            return [program("R, R, R") if agent == "tool" else "#### [R, R, R]"]
        return ["I cannot code." if agent == "tool" else "I do not know."]

    policy = ScriptedPolicy(script)
    result = asyncio.run(
        trajectory_rollout(
            lambda: masenvs.make("plan_path", max_rounds=2),
            0,
            policy,  # type: ignore[arg-type]
            episode=k,
            policy_of=lambda agent: agent,
            group_by=group_by,  # type: ignore[arg-type]
            rollout_id=f"t-e{k}",
            reset_options={"task": TASK},
            sample_seed=5,
        )
    )
    return result, policy


def test_turn_agent_groups_compare_the_same_turn_of_k_episodes() -> None:
    (solved, p0), (failed, p1) = episode(0, "turn_agent"), episode(1, "turn_agent")
    # One answer per turn (n=1), no branching; each call seeded on its own episode.
    assert [(agent, n) for agent, n, _ in p0.calls] == [("tool", 1), ("plan", 1)]
    assert [(agent, n) for agent, n, _ in p1.calls] == [("tool", 1), ("plan", 1)] * 2
    assert p0.seeds[0] is not None and p0.seeds[0] != p1.seeds[0]
    assert (solved.success, solved.rounds) == (True, 1)
    assert (failed.success, failed.rounds) == (False, 2)
    groups: dict[tuple, list[float]] = {}
    for s in solved.samples + failed.samples:
        groups.setdefault(s.group, []).append(s.reward)
    assert {g: len(r) for g, r in groups.items()} == {
        ("plan_path:0", 0, "tool"): 2,
        ("plan_path:0", 0, "plan"): 2,
        ("plan_path:0", 1, "tool"): 1,
        ("plan_path:0", 1, "plan"): 1,
    }
    # The team term the plan's goal pays reaches the tool that acted before it (alpha *
    # r_team + r_loc for every agent), shown in meta and in the metrics.
    tool = next(s for s in solved.samples if s.agent == "tool")
    assert tool.meta["team_term"] > 0 and tool.meta["episode"] == 0
    assert tool.meta["rollout_id"] == "t-e0"
    assert tool.meta["seed"] == 0  # the task seed
    assert tool.reward == pytest.approx(solved.rewards["tool"])
    assert "team_term" not in next(s for s in failed.samples if s.agent == "tool").meta
    metrics = team_term_metrics(solved.samples + failed.samples)
    assert metrics["train/team_term/tool"] == pytest.approx(tool.meta["team_term"] / 3)
    assert metrics["train/team_term/plan"] == 0.0
    tool0 = groups[("plan_path:0", 0, "tool")]
    assert tool0[0] > tool0[1]  # across trajectories the team term counts


def test_agent_groups_give_every_call_its_episode_return() -> None:
    (solved, _), (failed, _) = episode(0, "agent"), episode(1, "agent")
    for result in (solved, failed):
        for s in result.samples:
            assert s.group == ("plan_path:0", s.agent)
            assert s.reward == pytest.approx(result.rewards[s.agent])
    tool = [s.reward for s in solved.samples + failed.samples if s.agent == "tool"]
    assert len(tool) == 3 and tool[0] > tool[1] == tool[2]


# One trajectory-mode training step of every env, tiny model, embedded engine.
ENVS: dict[str, list[str]] = {
    "plan_path": ["env.options={size: 4}"],
    "sudoku": [],
    "sokoban": [],
    "math": ["env.options={source: generated}"],
    "code": ["env.options={source: builtin}"],
    "verilog": ["env.options={kind: combinational}"],
    "web_search": [],
    "auto_mas": [],
}


@pytest.mark.parametrize("group_by", ["turn_agent", "agent"])
@pytest.mark.parametrize("env", list(ENVS))
def test_one_trajectory_step_trains_in_every_env(env: str, group_by: str, tmp_path: Path) -> None:
    if group_by == "agent" and env != "plan_path":
        pytest.skip("the grouping ablation is env-independent: one env is enough")
    overrides: list[Any] = [
        f"run_dir={tmp_path}",
        "model.name=tiny",
        "steps=1",
        f"env.name={env}",
        *ENVS[env],
        "rollout.mode=trajectory",
        f"rollout.group_by={group_by}",
        "rollout.branches=2",
        "rollout.tasks_per_step=2",
        "rollout.max_rounds=1",
        "rollout.max_tokens=8",
        "validation.every=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        "backend.dtype=float32",
    ]
    cfg = load_config(None, overrides)
    assert train(cfg).steps == 1
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["train/failed_tasks"] == 0
    agents = masenvs.env_class(env).roles
    assert any(f"train/team_term/{a}" in row for a in agents)
    episodes = {f"s1-{seed}-e{k}" for seed in (0, 1) for k in (0, 1)}
    calls = [c for c in TraceStore(tmp_path / "traces").calls() if c.rollout_id in episodes]
    assert {c.rollout_id for c in calls} == episodes  # K episodes of each task, no tree
    assert all(len(c.choices) == 1 for c in calls)  # one answer per turn
    assert sum(row.get(f"learner/{a}/tokens", 1) for a in agents) > 0


def test_the_team_term_also_reaches_agents_acting_after_the_step_that_decides_it() -> None:
    """Code's coder decides the team outcome; the tester acts after it in the round and
    gets the same alpha * r_team on each of its samples (constant within its group)."""
    from masenvs.trainer.rollout.tree import RoundCredit
    from masenvs.trainer.samples import Sample, tree_group

    def sample(agent: str, reward: float) -> Sample:
        return Sample([1], [2], [], agent, agent, tree_group("code:0", 0, agent), reward)

    credit = RoundCredit()
    coder = sample("coder", 1.5)  # its own reward already holds the team part it decided
    credit.add("coder", coder)
    credit.commit("coder", {"coder": 1.5, "tester": 0.8})  # the env pays the tester 0.8
    testers = [sample("tester", 0.2), sample("tester", 0.0)]
    for s in testers:
        credit.add("tester", s)
    credit.commit("tester", {"coder": 0.0, "tester": 0.2})
    assert [s.reward for s in testers] == pytest.approx([1.0, 0.8])
    assert [s.meta["team_term"] for s in testers] == pytest.approx([0.8, 0.8])
    assert coder.reward == 1.5 and "team_term" not in coder.meta
    credit.clear()  # a new round owes nobody anything
    late = sample("tester", 0.0)
    credit.add("tester", late)
    assert late.reward == 0.0
