"""Tree-structured sampling (AT-GRPO, Stronger-MAS §3): K candidates per agent per round.

At every round of a task each live agent samples K candidates from the same observation (one
request with `n=K`). Agents are scored one after another in role order: agent i's candidate
k is played on a branch restored from the round's snapshot, with the agents before i on
their committed actions and the agents after i on their first candidate, so the K rewards of
a group differ only through agent i's own answer. The best candidate is committed, and once
every agent has committed, the episode continues from that joint action. Every candidate
becomes a training sample in group (task, round, agent).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from masenvs.adapters.policy import ChatPolicy, Reply
from masenvs.env import MASEnv
from masenvs.trainer.samples import Sample, tree_group


@dataclass
class TaskRollout:
    """One task's tree rollout: the committed path's outcome and every candidate's sample."""

    task_id: str
    seed: int
    success: bool = False
    rounds: int = 0
    rewards: dict[str, float] = field(default_factory=dict)  # committed path, per agent
    samples: list[Sample] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Scored:
    reply: Reply
    reward: float  # the agent's combined reward for the round
    team: float


def choose(scored: list[Scored], select_by: Literal["team", "agent"]) -> int:
    """Index of the candidate to commit: best team reward (ties: own reward), or own reward."""
    if select_by == "team":
        key = lambda i: (scored[i].team, scored[i].reward)  # noqa: E731
    else:
        key = lambda i: scored[i].reward  # noqa: E731
    return max(range(len(scored)), key=key)


async def tree_rollout(
    make_env: Callable[[], MASEnv],
    seed: int,
    policy: ChatPolicy,
    *,
    branches: int,
    policy_of: Callable[[str], str],
    select_by: Literal["team", "agent"] = "team",
    rollout_id: str,
    reset_options: dict[str, Any] | None = None,
) -> TaskRollout:
    env = make_env()
    _, infos = env.reset(seed=seed, options=reset_options)
    task_id = f"{env.name}:{seed}"
    result = TaskRollout(task_id=task_id, seed=seed)
    branch_envs = [make_env() for _ in range(branches)]
    totals: dict[str, float] = defaultdict(float)

    while env.agents:
        snapshot = env.snapshot()
        try:
            candidates = await policy.act_all(rollout_id, infos, n=branches)
        except Exception as exc:  # a failed call drops this task from the batch, not the run
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        committed = {agent: replies[0].text for agent, replies in candidates.items()}

        for agent in list(env.agents):
            scored = await asyncio.gather(
                *(
                    asyncio.to_thread(_score, branch, snapshot, committed, agent, reply)
                    for branch, reply in zip(branch_envs, candidates[agent])
                )
            )
            for s in scored:
                result.completion_tokens += len(s.reply.token_ids)
                if s.reply.token_ids and s.reply.prompt_token_ids:
                    result.samples.append(
                        Sample(
                            prompt_token_ids=s.reply.prompt_token_ids,
                            completion_token_ids=s.reply.token_ids,
                            behavior_logprobs=s.reply.logprobs
                            if len(s.reply.logprobs) == len(s.reply.token_ids)
                            else [],
                            agent=agent,
                            policy=policy_of(agent),
                            group=tree_group(task_id, env.round, agent),
                            reward=s.reward,
                            meta={"call_id": s.reply.call_id, "seed": seed},
                        )
                    )
            committed[agent] = scored[choose(scored, select_by)].reply.text

        env.restore(snapshot)
        _, rewards, _, _, infos = await asyncio.to_thread(env.step, committed)
        for agent, reward in rewards.items():
            totals[agent] += reward

    result.success = bool(env.state.success)
    result.rounds = env.round
    result.rewards = dict(totals)
    return result


def _score(
    branch: MASEnv, snapshot: Any, committed: dict[str, str], agent: str, reply: Reply
) -> Scored:
    branch.restore(snapshot)
    _, rewards, _, _, infos = branch.step({**committed, agent: reply.text})
    return Scored(reply, rewards[agent], infos[agent]["reward_parts"]["team"])


async def collect_tree_batch(
    make_env: Callable[[], MASEnv],
    seeds: list[int],
    policy: ChatPolicy,
    *,
    branches: int,
    policy_of: Callable[[str], str],
    select_by: Literal["team", "agent"] = "team",
    rollout_prefix: str = "train",
    concurrency: int = 8,
) -> list[TaskRollout]:
    """Tree rollouts of many tasks in flight at once (the backend batches their calls)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> TaskRollout:
        async with limit:
            return await tree_rollout(
                make_env,
                seed,
                policy,
                branches=branches,
                policy_of=policy_of,
                select_by=select_by,
                rollout_id=f"{rollout_prefix}-{seed}",
            )

    return await asyncio.gather(*(one(s) for s in seeds))
