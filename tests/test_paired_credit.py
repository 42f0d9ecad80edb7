"""Paired team credit (`rollout.team_credit: paired`): a first mover's candidate k is credited
with the team outcome of its own continuation of the round, as in the authors' engine.

In PettingLLMs at 0cff56f (sequential mode, the paper's), plan candidate k read tool candidate
k's output and stepped branch k; the tool's reward was its own moves' reward on a copy plus
`env.state.reward` after that plan step on the same branch k (`tool_agent.py:93-136`,
`plan_agent.py:79-96`). The policy here is scripted: the plan copies the moves the tool's
program printed, so a tool whose moves reach the goal leads the plan to the goal. The env and
the sandbox are the real ones.
"""

from __future__ import annotations

import asyncio
import re
import statistics
from typing import Any

import pytest

import masenvs
from masenvs.adapters.policy import Reply
from masenvs.env import MASEnv, RewardWeights
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import ConfigError, load_config
from masenvs.trainer.rollout.tree import TaskRollout, tree_rollout
from masenvs.trainer.update_config import AlgorithmConfig

# 4x4, start (0, 0), goal (0, 3): "R, R, R" is the one shortest path.
TASK = {"rows": ["....", ".##.", "....", "...."], "start": [0, 0], "goal": [0, 3]}


def program(moves: str) -> str:
    return f"```python\nprint('Moves: [{moves}]')\n```"


# Tool candidate 0 prints a path to the goal, 1 a move away from it, 2 writes no program.
TOOL = [program("R, R, R"), program("D"), "I cannot code."]


class EchoPlan:
    """The tool writes TOOL; the plan answers the moves the tool's program printed this round
    (or `[D]` when it printed none). Records every call as (agent, n, moves answered)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.seeds: list[int | None] = []

    async def act(
        self,
        rollout_id: str,
        agent: str,
        messages: list[dict[str, Any]],
        n: int = 1,
        seed: int | None = None,
    ) -> list[Reply]:
        if agent == "tool":
            texts = TOOL[:n]
            answer = ""
        else:
            printed = re.findall(r"Moves: \[([^\]]*)\]", messages[-1]["content"])
            answer = printed[-1] if printed else "D"
            texts = [f"#### [{answer}]"] * n
        self.calls.append((agent, n, answer))
        self.seeds.append(seed)
        return [
            Reply(t, 3, "stop", call_id=f"{agent}-{i}", token_ids=[7, 8, 9], prompt_token_ids=[1])
            for i, t in enumerate(texts)
        ]


def rollout(
    policy: EchoPlan, team_credit: str, sample_seed: int | None = None, **env_config: Any
) -> TaskRollout:
    def make_env() -> MASEnv:
        return masenvs.make("plan_path", **env_config)

    return asyncio.run(
        tree_rollout(
            make_env,
            0,
            policy,  # type: ignore[arg-type]
            branches=len(TOOL),
            policy_of=lambda agent: agent,
            rollout_id="t",
            reset_options={"task": TASK},
            team_credit=team_credit,  # type: ignore[arg-type]
            sample_seed=sample_seed,
        )
    )


def own_reward(sample: Any, weights: RewardWeights) -> float:
    """The reward the env paid the tool for its own step (its moves scored on a copy)."""
    parts = sample.meta["reward_parts"]
    return weights.process * parts["process"] + weights.agent * parts["agent"]


def tool_samples(result: TaskRollout) -> list[Any]:
    return sorted((s for s in result.samples if s.agent == "tool"), key=lambda s: s.meta["choice"])


ALPHA = 2.0


def test_each_tool_candidate_gets_the_team_term_of_its_own_plan_continuation() -> None:
    weights = RewardWeights(team=ALPHA)
    cfg = masenvs.make("plan_path").config
    goal_term = ALPHA * (cfg.goal_bonus + cfg.optimal_bonus)  # 3 moves: BFS-optimal
    policy = EchoPlan()
    result = rollout(policy, "paired", reward_weights=weights.model_dump())

    tools = tool_samples(result)
    # The authors' credit: own moves' reward, plus the plan step's team reward on branch k.
    assert [s.meta["team_term"] for s in tools] == pytest.approx([goal_term, 0.0, 0.0])
    for s in tools:
        assert s.reward == pytest.approx(own_reward(s, weights) + s.meta["team_term"])
    # One plan continuation per tool candidate (n=1, each reading its own tool's output),
    # then the committed path's plan turn; the last actor gets no continuation.
    assert policy.calls == [
        ("tool", 3, ""),
        ("plan", 1, "R, R, R"),
        ("plan", 1, "D"),
        ("plan", 1, "D"),
        ("plan", 3, "R, R, R"),
    ]
    assert result.paired_calls == 3
    # The continuations are not training samples: K tool and K plan candidates.
    assert sorted(s.agent for s in result.samples) == ["plan"] * 3 + ["tool"] * 3
    assert result.success and result.error is None


def test_committed_credit_pays_every_tool_candidate_the_committed_plans_term() -> None:
    weights = RewardWeights(team=ALPHA)
    policy = EchoPlan()
    result = rollout(policy, "committed", reward_weights=weights.model_dump())
    terms = [s.meta["team_term"] for s in tool_samples(result)]
    assert len(set(terms)) == 1 and terms[0] > 0  # the committed plan reached the goal
    assert [agent for agent, _, _ in policy.calls] == ["tool", "plan"]
    assert result.paired_calls == 0


@pytest.mark.parametrize("team_credit", ["committed", "paired"])
def test_a_global_reward_moves_the_tool_only_with_paired_credit(team_credit: str) -> None:
    # The alpha ablation at its extreme: the tool's own parts weigh 0, only the team term counts.
    weights = RewardWeights(process=0.0, agent=0.0, team=1.0)
    result = rollout(EchoPlan(), team_credit, reward_weights=weights.model_dump())
    trained, _ = group_advantages(result.samples, AlgorithmConfig())
    advantages = [s.advantage for s in trained if s.agent == "tool"]
    spread = statistics.pstdev(advantages) if advantages else 0.0
    if team_credit == "paired":
        assert spread > 0.5
        best = max((s for s in trained if s.agent == "tool"), key=lambda s: s.advantage)
        assert best.meta["choice"] == 0  # the candidate whose moves the plan followed to G
    else:
        assert spread == 0.0


def test_team_credit_is_a_rollout_option_that_names_its_values() -> None:
    assert load_config(None).rollout.team_credit == "committed"  # today's behaviour
    assert load_config(None, ["rollout.team_credit=paired"]).rollout.team_credit == "paired"
    with pytest.raises(ConfigError, match=r"rollout\.team_credit.*'committed' or 'paired'"):
        load_config(None, ["rollout.team_credit=pairs"])
    with pytest.raises(ConfigError, match=r"team_credit.*tree"):
        load_config(None, ["rollout.team_credit=paired", "rollout.mode=trajectory"])


def test_a_seeded_run_seeds_each_continuation_apart_and_repeats_them() -> None:
    first, again = EchoPlan(), EchoPlan()
    rollout(first, "paired", sample_seed=0)
    rollout(again, "paired", sample_seed=0)
    assert first.seeds == again.seeds  # a rerun asks for the same answers
    assert None not in first.seeds and len(set(first.seeds)) == len(first.seeds)
