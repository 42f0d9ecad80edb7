"""The authors' baselines and grouping ablations as options: `rollout.mode: no_tree` (their
`+rollout_mode=no_tree`) and `rollout.group_by` turn_agent / agent / turn / task (the grouping
table: both / agent-only / turn-only / no grouping).

The policy is scripted on the real plan-path env, as tests/test_trajectory.py does."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_tree_rollout import TASK, ScriptedPolicy

import masenvs
from masenvs.adapters.policy import Reply
from masenvs.overrides import ConfigError
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import load_config
from masenvs.trainer.rollout.grouping import regroup
from masenvs.trainer.rollout.tree import collect_trajectory_batch, tree_rollout
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train
from masenvs.trainer.samples import Sample
from masenvs.trainer.update_config import AlgorithmConfig


class EpisodePolicy:
    """`ChatPolicy.act`'s signature; the answer depends on the episode (`...-e<k>`) and round."""

    def __init__(self, plan: dict[int, dict[int, str]]) -> None:
        self.plan = plan  # episode -> round -> the plan's answer; missing: "I do not know."

    async def act(
        self,
        rollout_id: str,
        agent: str,
        messages: list[dict[str, Any]],
        n: int = 1,
        seed: int | None = None,
    ) -> list[Reply]:
        episode = int(rollout_id.rsplit("-e", 1)[1])
        round_ = int(messages[-1]["content"].split("Round ")[1].split(" ")[0]) - 1
        text = "I cannot code."
        if agent == "plan":
            text = self.plan.get(episode, {}).get(round_, "I do not know.")
        return [Reply(text, 3, "stop", call_id=agent, token_ids=[7, 8], prompt_token_ids=[1])]


def three_episodes(policy_of: Any, no_tree: bool) -> list:
    """K=3 episodes of one 3-round task: episode 0 reaches the goal in its 2nd turn (R, then
    R R); episodes 1 and 2 never move and end after their 3rd turn."""
    policy = EpisodePolicy({0: {0: "#### [R]", 1: "#### [R, R]"}})
    return asyncio.run(
        collect_trajectory_batch(
            lambda: masenvs.make("plan_path", max_rounds=3),
            [0],
            policy,  # type: ignore[arg-type]
            branches=3,
            policy_of=policy_of,
            rollout_prefix="t",
            reset_options={"task": TASK},
            no_tree=no_tree,
        )
    )


def test_no_tree_trains_only_the_tasks_last_turn_in_one_group_per_policy() -> None:
    # The authors' rule: of a problem's K rollouts keep only the samples whose turn is the
    # largest turn any of them reached (turns 2, 3, 3 here: the turn-3 samples of episodes 1
    # and 2); the group is the problem, shared by every agent of one policy.
    results = three_episodes(lambda agent: "shared", no_tree=True)
    assert [r.rounds for r in results] == [2, 3, 3]
    assert results[0].success and not results[1].success  # outcomes are the episodes' own
    kept = [(s.meta["episode"], s.meta["round"], s.agent) for r in results for s in r.samples]
    assert sorted(kept) == [(1, 2, "plan"), (1, 2, "tool"), (2, 2, "plan"), (2, 2, "tool")]
    assert {s.group for r in results for s in r.samples} == {("plan_path:0", "shared")}
    # Each kept sample's reward is its agent's reward of that turn, as in trajectory mode.
    every = three_episodes(lambda agent: "shared", no_tree=False)
    turn = {
        (s.meta["episode"], s.meta["round"], s.agent): s.reward for r in every for s in r.samples
    }
    for s in (s for r in results for s in r.samples):
        assert s.reward == turn[(s.meta["episode"], s.meta["round"], s.agent)]


def test_no_tree_with_a_policy_per_agent_keeps_one_group_per_policy() -> None:
    # A baseline never spans two policies: with one adapter per agent each agent's last-turn
    # samples form the task's group of that policy (the authors' per-model batches).
    results = three_episodes(lambda agent: agent, no_tree=True)
    samples = [s for r in results for s in r.samples]
    assert Counter(s.group for s in samples) == {
        ("plan_path:0", "tool"): 2,
        ("plan_path:0", "plan"): 2,
    }
    advantaged, stats = group_advantages(samples, AlgorithmConfig())
    assert stats.groups == 2 and len(advantaged) == 4


def hand_built(policy_of: Any) -> list[Sample]:
    """Two rounds of a tool -> plan team on one task: four calls."""
    return [
        Sample([1], [2], [], agent, policy_of(agent), ("?",), reward, meta={"round": round_})
        for round_, agent, reward in [
            (0, "tool", 0.1),
            (0, "plan", 0.2),
            (1, "tool", 0.3),
            (1, "plan", 0.4),
        ]
    ]


@pytest.mark.parametrize(
    ("group_by", "shared", "per_agent"),
    [
        # both: (task, turn, agent)
        ("turn_agent", [("t", 0, "tool"), ("t", 0, "plan"), ("t", 1, "tool"), ("t", 1, "plan")],
         [("t", 0, "tool"), ("t", 0, "plan"), ("t", 1, "tool"), ("t", 1, "plan")]),
        # agent-only: (task, agent)
        ("agent", [("t", "tool"), ("t", "plan"), ("t", "tool"), ("t", "plan")],
         [("t", "tool"), ("t", "plan"), ("t", "tool"), ("t", "plan")]),
        # turn-only: (task, turn) for the agents of one policy
        ("turn", [("t", 0, "shared"), ("t", 0, "shared"), ("t", 1, "shared"), ("t", 1, "shared")],
         [("t", 0, "tool"), ("t", 0, "plan"), ("t", 1, "tool"), ("t", 1, "plan")]),
        # no grouping: one group per task (and policy)
        ("task", [("t", "shared")] * 4, [("t", "tool"), ("t", "plan"), ("t", "tool"), ("t", "plan")]),
    ],
)  # fmt: skip
def test_the_four_grouping_keys(group_by: str, shared: list, per_agent: list) -> None:
    for policy_of, expected in ((lambda a: "shared", shared), (lambda a: a, per_agent)):
        samples = hand_built(policy_of)
        regroup(samples, "t", group_by)  # type: ignore[arg-type]
        assert [s.group for s in samples] == expected
        group_advantages(samples, AlgorithmConfig())  # no group mixes two policies


def test_tree_mode_groups_a_rounds_candidates_of_every_agent_by_turn() -> None:
    policy = ScriptedPolicy(lambda agent, round_, n: ["I do not know."] * n)
    result = asyncio.run(
        tree_rollout(
            lambda: masenvs.make("plan_path", max_rounds=2),
            0,
            policy,  # type: ignore[arg-type]
            branches=2,
            policy_of=lambda agent: "shared",
            rollout_id="t",
            reset_options={"task": TASK},
            group_by="turn",
        )
    )
    assert Counter(s.group for s in result.samples) == {
        ("plan_path:0", 0, "shared"): 4,  # 2 tool and 2 plan candidates of round 0
        ("plan_path:0", 1, "shared"): 4,
    }


def test_trajectory_mode_without_turns_in_the_key_rewards_the_episode_return() -> None:
    # A group that pools turns ('agent', 'task') compares whole episodes: each call gets its
    # agent's episode return, as group_by 'agent' always did in trajectory mode.
    results = asyncio.run(
        collect_trajectory_batch(
            lambda: masenvs.make("plan_path", max_rounds=3),
            [0],
            EpisodePolicy({0: {0: "#### [R]", 1: "#### [R, R]"}}),  # type: ignore[arg-type]
            branches=2,
            policy_of=lambda agent: "shared",
            group_by="task",
            rollout_prefix="t",
            reset_options={"task": TASK},
        )
    )
    for r in results:
        assert all(s.reward == pytest.approx(r.rewards[s.agent]) for s in r.samples)
        assert {s.group for s in r.samples} == {("plan_path:0", "shared")}


def test_no_tree_groups_by_task_and_says_so_when_asked_for_another_grouping() -> None:
    assert load_config(None, ["rollout.mode=no_tree"]).rollout.mode == "no_tree"
    assert load_config(None, ["rollout.mode=no_tree", "rollout.group_by=task"])
    with pytest.raises(ConfigError, match="no_tree"):
        load_config(None, ["rollout.mode=no_tree", "rollout.group_by=agent"])


def test_one_no_tree_step_trains(tmp_path: Path) -> None:
    overrides = [
        f"run_dir={tmp_path}",
        "model.name=tiny",
        "steps=1",
        "env.options={size: 4}",
        "rollout.mode=no_tree",
        "rollout.branches=2",
        "rollout.tasks_per_step=2",
        "rollout.max_rounds=2",
        "rollout.max_tokens=8",
        "validation.every=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        "backend.dtype=float32",
    ]
    assert train(load_config(None, overrides)).steps == 1
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["train/failed_tasks"] == 0
    # 2 tasks x 2 policies (one per agent); the tiny model reaches no goal, so every episode
    # runs 2 rounds and only round 2's 2 x 2 samples per task train.
    assert row["groups/groups"] == 4
    assert row["groups/samples_kept"] <= 8


class Unsure:
    """`ChatPolicy.act`'s signature: every candidate says it does not know."""

    async def act(
        self, rollout_id: str, agent: str, messages: list[dict[str, Any]], n: int = 1, **_: Any
    ) -> list[Reply]:
        return [Reply("I do not know.", 3, "stop", token_ids=[7], prompt_token_ids=[1])] * n


SINGLE = {  # the authors' L0 single agents: plan (stateful), reasoner (math), coder (code)
    "plan_path": ("plan", {}),
    "sudoku": ("plan", {}),
    "sokoban": ("plan", {}),
    "math": ("reasoner", {"source": "generated"}),
    "code": ("coder", {"source": "builtin"}),
}


@pytest.mark.parametrize("env_name", list(SINGLE))
def test_every_paper_task_runs_single_agent_tree_grpo(env_name: str) -> None:
    # The authors' single-agent "GRPO" is tree sampling with one agent: here
    # env.options.single_agent with rollout.mode tree, K candidates of the one role per turn.
    role, options = SINGLE[env_name]
    result = asyncio.run(
        tree_rollout(
            lambda: masenvs.make(env_name, single_agent=True, max_rounds=2, **options),
            0,
            Unsure(),  # type: ignore[arg-type]
            branches=3,
            policy_of=lambda agent: agent,
            rollout_id="sa",
        )
    )
    assert result.error is None
    assert Counter(s.group for s in result.samples) == {
        (f"{env_name}:0", r, role): 3 for r in range(result.rounds)
    }
    assert result.rounds >= 1
