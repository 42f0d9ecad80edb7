"""Tree sampling and independent episodes follow the env's turn order (AT-GRPO, Stronger-MAS).

The policy is scripted (it stands in for the LLM and records every prompt it is shown); the
env and the sandbox that runs the tool's programs are the real ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import masenvs
from masenvs.adapters.episodes import run_episode
from masenvs.adapters.policy import Reply
from masenvs.env import MASEnv
from masenvs.sandbox import Sandbox
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.rollout.sources import env_options
from masenvs.trainer.rollout.tree import TaskRollout, tree_rollout

# 4x4, start (0, 0), goal (0, 3): "R, R, R" is the one shortest path.
TASK = {"rows": ["....", ".##.", "....", "...."], "start": [0, 0], "goal": [0, 3]}


def program(moves: str) -> str:
    return f"```python\nprint('Moves: [{moves}]')\n```"


class ScriptedPolicy:
    """`ChatPolicy.act`'s signature; answers come from `script(agent, round, n)`."""

    def __init__(self, script: Callable[[str, int, int], list[str]]) -> None:
        self.script = script
        self.calls: list[tuple[str, int, str]] = []  # (agent, n, the prompt's user message)
        self.seeds: list[int | None] = []

    async def act(
        self,
        rollout_id: str,
        agent: str,
        messages: list[dict[str, Any]],
        n: int = 1,
        seed: int | None = None,
    ) -> list[Reply]:
        prompt = messages[-1]["content"]
        self.calls.append((agent, n, prompt))
        self.seeds.append(seed)
        round_ = int(prompt.split("Round ")[1].split(" ")[0]) - 1
        texts = self.script(agent, round_, n)
        assert len(texts) == n
        return [
            Reply(
                text, 3, "stop", call_id=f"{agent}-{i}", token_ids=[7, 8, 9], prompt_token_ids=[1]
            )
            for i, text in enumerate(texts)
        ]


def rollout(
    policy: ScriptedPolicy,
    branches: int = 3,
    select_by: str = "agent",
    sample_seed: int | None = None,
    **env_config: Any,
) -> TaskRollout:
    def make_env() -> MASEnv:
        return masenvs.make("plan_path", **env_config)

    return asyncio.run(
        tree_rollout(
            make_env,
            0,
            policy,  # type: ignore[arg-type]
            branches=branches,
            policy_of=lambda agent: agent,
            select_by=select_by,  # type: ignore[arg-type]
            rollout_id="t",
            reset_options={"task": TASK},
            sample_seed=sample_seed,
        )
    )


@pytest.fixture
def sandbox_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every program the sandbox runs, in order (the runs themselves are real)."""
    runs: list[str] = []
    real_run = Sandbox.run

    def counting_run(self: Sandbox, code: str, *args: Any, **kwargs: Any) -> Any:
        runs.append(code)
        return real_run(self, code, *args, **kwargs)

    monkeypatch.setattr(Sandbox, "run", counting_run)
    return runs


def test_each_agent_branches_from_the_committed_state_in_turn_order(sandbox_runs) -> None:
    def script(agent: str, round_: int, n: int) -> list[str]:
        if agent == "tool":  # k=1 finds the shortest path; k=2 writes no program
            return [program("D"), program("R, R, R"), "I cannot code."]
        if round_ == 0:  # one step right is the best plan
            return ["#### [D]", "#### [R]", "I do not know."]
        return ["#### [R, R]", "#### [D, D]", "#### [L]"]

    policy = ScriptedPolicy(script)
    result = rollout(policy)

    # Turns: tool then plan, each one request with n=K, two rounds until the goal.
    assert [(agent, n) for agent, n, _ in policy.calls] == [("tool", 3), ("plan", 3)] * 2
    # The plan's prompt holds the committed tool candidate's program and output, this round.
    plan_prompt = policy.calls[1][2]
    assert "Round 1 of 4" in plan_prompt
    assert "print('Moves: [R, R, R]')" in plan_prompt and "Moves: [D]" not in plan_prompt
    # Round 2 starts where the committed plan ("R") left the agent: (0, 1).
    assert "row 0, column 1" in policy.calls[2][2]
    assert result.success and result.rounds == 2 and result.error is None

    # Every candidate is a sample in group (task, round, agent); rewards are the env's.
    groups: dict[tuple, list[float]] = {}
    for s in result.samples:
        groups.setdefault(s.group, []).append(s.reward)
    assert sorted(groups, key=lambda g: (g[1], g[2] != "tool")) == [
        ("plan_path:0", 0, "tool"),
        ("plan_path:0", 0, "plan"),
        ("plan_path:0", 1, "tool"),
        ("plan_path:0", 1, "plan"),
    ]
    assert all(len(rewards) == 3 for rewards in groups.values())
    tool0 = groups[("plan_path:0", 0, "tool")]
    assert tool0[1] > tool0[0] > tool0[2] == -1.0  # shortest path > wrong move > no program
    plan0 = groups[("plan_path:0", 0, "plan")]
    assert plan0[1] > plan0[0] and plan0[2] == -1.0
    # The goal bonus (1.0: 3 moves in all = BFS length, +0.5) counts once in the plan's reward.
    plan1 = groups[("plan_path:0", 1, "plan")]
    assert 1.5 < plan1[0] < 2.5

    # Each tool candidate ran exactly once; the committed one was not run again.
    assert len(sandbox_runs) == 2 * 2  # two rounds x two candidates with a program


def test_a_branch_is_scored_once_and_committed_as_is(sandbox_runs) -> None:
    def script(agent: str, round_: int, n: int) -> list[str]:
        if agent == "tool":
            return [program("D"), program("R, R, R"), program("R")]
        return ["#### [R, R, R]", "nothing", "#### [D]"]

    policy = ScriptedPolicy(script)
    result = rollout(policy)
    assert result.success and result.rounds == 1
    # One run per candidate, in the branches; committing replays nothing.
    assert sorted(code.strip() for code in sandbox_runs) == [
        "print('Moves: [D]')",
        "print('Moves: [R, R, R]')",
        "print('Moves: [R]')",
    ]
    # The committed path's rewards: the tool's own outcome, and the team's once for each.
    # Every tool candidate also carries the team term the plan's goal paid (alpha * r_team
    # for every agent): one constant of the group, so no advantage moves.
    tool = [s for s in result.samples if s.agent == "tool"]
    assert [s.meta["team_term"] for s in tool] == pytest.approx([1.5] * 3)
    tool_own = max(s.reward - s.meta["team_term"] for s in tool)
    assert result.rewards["tool"] == pytest.approx(tool_own + 1.5)
    assert max(s.reward for s in tool) == pytest.approx(result.rewards["tool"])


def test_simultaneous_turns_hide_this_rounds_tool_output_from_the_plan() -> None:
    def script(agent: str, round_: int, n: int) -> list[str]:
        return [program("R, R, R")] * n if agent == "tool" else ["nothing"] * n

    policy = ScriptedPolicy(script)
    rollout(policy, branches=2, turn_order="simultaneous", max_rounds=2)
    plan_prompts = [prompt for agent, _, prompt in policy.calls if agent == "plan"]
    assert "Moves: [R, R, R]" not in plan_prompts[0]  # round 1: the round as it began
    assert "Moves: [R, R, R]" in plan_prompts[1]  # round 2: the tool's round-1 output


def test_select_by_agent_is_the_default_and_team_is_an_option() -> None:
    # Plan candidates: 20 moves off the grid, then the shortest path (goal, but a poor own
    # mixed reward: 20 invalid moves), or two good steps (no goal yet, better own reward).
    wasteful = "#### [" + "U, " * 20 + "R, R, R]"

    def script(agent: str, round_: int, n: int) -> list[str]:
        if agent == "tool":
            return ["no program"] * n
        return [wasteful, "#### [R, R]"] if round_ == 0 else ["#### [R]"] * n

    by_agent, by_team = ScriptedPolicy(script), ScriptedPolicy(script)
    agent_result = rollout(by_agent, branches=2, select_by="agent")
    team_result = rollout(by_team, branches=2, select_by="team")
    plan0 = [s.reward for s in agent_result.samples if s.group[1:] == (0, "plan")]
    assert plan0[1] > plan0[0]  # own mixed reward: the two good steps
    assert agent_result.rounds == 2 and agent_result.success  # so the goal came next round
    assert team_result.rounds == 1 and team_result.success  # team reward: the goal at once
    assert TrainConfig().rollout.select_by == "agent"  # the paper's default


def test_independent_episodes_take_turns_too() -> None:
    def script(agent: str, round_: int, n: int) -> list[str]:
        return [program("R, R, R")] if agent == "tool" else ["#### [R, R, R]"]

    policy = ScriptedPolicy(script)
    env = masenvs.make("plan_path")
    result = asyncio.run(run_episode(env, policy, 0, options={"task": TASK}))  # type: ignore[arg-type]
    assert [agent for agent, _, _ in policy.calls] == ["tool", "plan"]
    assert "print('Moves: [R, R, R]')" in policy.calls[1][2]
    assert result.success and result.actions == [
        {"tool": program("R, R, R"), "plan": "#### [R, R, R]"}
    ]


def test_the_trainer_passes_turn_order_to_the_env() -> None:
    cfg = TrainConfig.model_validate({"rollout": {"turn_order": "simultaneous"}})
    assert env_options(cfg)["turn_order"] == "simultaneous"
    assert env_options(TrainConfig())["turn_order"] == "sequential"
    clash = TrainConfig.model_validate(
        {
            "env": {"options": {"turn_order": "simultaneous"}},
            "rollout": {"turn_order": "sequential"},
        }
    )
    with pytest.raises(ValueError, match="rollout.turn_order"):
        env_options(clash)


def test_masenvs_play_asks_each_agent_in_turn_and_shows_the_tools_output() -> None:
    import argparse
    import io

    from rich.console import Console

    from masenvs.cli import cmd_play

    console = Console(record=True, width=200)
    typed = io.StringIO(
        "```python\nprint('Moves: ' + 'L' * 7)\n```\n.\n"  # the tool's turn
        "no idea\n.\n"  # the plan's turn
    )
    args = argparse.Namespace(env="plan_path", seed=0, set=["max_rounds=1"], single_agent=False)
    assert cmd_play(args, console, typed) == 0
    shown = console.export_text()
    tool_turn, plan_turn = shown.split("tool > ")[0], shown.split("tool > ")[1]
    assert "plan · user" not in tool_turn and "plan > " in plan_turn
    assert "Moves: LLLLLLL" in plan_turn.split("plan > ")[0]  # before the plan answers
    assert "round 1, plan's turn" in shown and "episode over after 1 round(s)" in shown


def test_each_turn_asks_with_its_own_seed_when_seeded() -> None:
    from masenvs.trainer.rollout.tree import call_seed

    def script(agent: str, round_: int, n: int) -> list[str]:
        return ["Moves: [R]"] * n

    for sample_seed in (None, 5):
        policy = ScriptedPolicy(script)
        result = rollout(
            policy, branches=2, sample_seed=sample_seed, max_rounds=2, tool_task="propose"
        )
        assert {sample.meta["seed"] for sample in result.samples} == {0}  # the task's seed
        turns = [(agent, i // 2) for i, (agent, _, _) in enumerate(policy.calls)]
        assert policy.seeds == [call_seed(sample_seed, "t", r, a) for a, r in turns]
        assert (len(set(policy.seeds)) == len(turns)) == (sample_seed is not None)


def test_a_call_over_the_request_timeout_says_which_setting_raises_it() -> None:
    """The trainer's policy calls wait backend.request_timeout (was a fixed 600 s), and a call
    that takes longer fails naming that setting, in the task's error."""
    import socket

    from masenvs.adapters.policy import ChatPolicy

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        policy = ChatPolicy(url, timeout=0.5)
        rollout = asyncio.run(
            tree_rollout(
                lambda: masenvs.make("plan_path", size=4),
                0,
                policy,
                branches=2,
                policy_of=lambda agent: agent,
                rollout_id="r0",
            )
        )
        assert rollout.error is not None and "backend.request_timeout" in rollout.error
        assert "0.5 s" in rollout.error
    finally:
        silent.close()
