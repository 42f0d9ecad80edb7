"""Tree-structured sampling (AT-GRPO, Stronger-MAS §3): K candidates per agent per turn;
and its baselines without a tree, K independent episodes per task, trained on every turn
(`trajectory`) or on the task's last turn only (the authors' `no_tree`) (end of the file).

Agents act one after another in the env's turn order; each env step is one agent's turn.
At every turn the acting agent samples K candidates from the same state (one request with
`n=K`). Candidate k is played once on its own branch, restored from the turn's snapshot,
and scored by the reward the env gives that agent for it. The best candidate (by the agent's
own mixed reward, the paper's default, or by the team reward) is committed: its branch *is*
the committed state, so nothing is replayed and no tool program runs twice. The next agent
then samples from that state, which shows what the agents before it did this round. Every
candidate becomes a training sample in group (task, round, agent), or
another `group_by` key (trainer/rollout/grouping.py). The team term of an agent
that acts before the round's last actor is the committed path's (`RoundCredit`), or with
`team_credit="paired"` its own branch's continuation's (trainer/rollout/paired_credit.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from masenvs.adapters.policy import ChatPolicy, Reply
from masenvs.env import MASEnv, Snapshot
from masenvs.trainer.rollout.grouping import GroupBy, last_turn_only, regroup, spans_turns
from masenvs.trainer.rollout.paired_credit import Continuations, TeamCredit
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
    # Runs the env made through the endpoint (auto-MAS executions), from every candidate:
    # their calls are samples too (trainer/rollout/captured.py).
    captured: list[dict[str, Any]] = field(default_factory=list)
    designs: list[dict[str, Any]] = field(default_factory=list)  # auto-MAS: every candidate's
    metrics: dict[str, float] = field(default_factory=dict)  # env.episode_metrics(), committed path
    paired_calls: int = 0  # calls of paired credit's continuations (not samples)


@dataclass
class Scored:
    """One candidate played on its branch: the step's results, kept for committing."""

    reply: Reply
    reward: float  # the acting agent's mixed reward for its turn
    team: float
    rewards: dict[str, float]  # every live agent's reward from this step
    infos: dict[str, dict[str, Any]]


def choose(scored: list[Scored], select_by: Literal["team", "agent"]) -> int:
    """Index of the candidate to commit: best own mixed reward, or best team reward (ties:
    own reward). The first of equal candidates wins, so ties are deterministic."""
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
    select_by: Literal["team", "agent"] = "agent",
    rollout_id: str,
    reset_options: dict[str, Any] | None = None,
    sample_seed: int | None = None,
    group_by: GroupBy = "turn_agent",
    team_credit: TeamCredit = "committed",
) -> TaskRollout:
    env = make_env()
    _, infos = env.reset(seed=seed, options=reset_options)
    task_id = f"{env.name}:{seed}"
    result = TaskRollout(task_id=task_id, seed=seed)
    branch_envs = [make_env() for _ in range(branches)]
    totals: dict[str, float] = defaultdict(float)
    this_round = RoundCredit()  # the round's samples, for the team term
    continuations = Continuations(  # team_credit="paired"
        make_env, policy, rollout_id, partial(paired_seed, sample_seed, rollout_id)
    )

    while env.agents:
        agent, round_ = env.acting, env.round
        if env.turn == 0:
            this_round.clear()
        snapshot = env.snapshot()
        try:
            turn_seed = call_seed(sample_seed, rollout_id, round_, agent)
            # Only when seeded: policies written before seeds take no `seed`.
            extra = {} if turn_seed is None else {"seed": turn_seed}
            messages = infos[agent]["messages"]
            replies = await policy.act(rollout_id, agent, messages, n=branches, **extra)
        except Exception as exc:  # a failed call drops this task from the batch, not the run
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        if not replies:
            result.error = f"the policy returned no candidates for {agent!r}"
            return result
        scored = await asyncio.gather(
            *(
                asyncio.to_thread(_play, branch, snapshot, agent, reply)
                for branch, reply in zip(branch_envs, replies)
            )
        )
        terms: list[float | None] = [None] * len(scored)  # None: RoundCredit pays the term
        if team_credit == "paired" and env.turn < len(env.agents) - 1:  # a later agent decides
            try:  # each candidate's team term, from its own continuation of the round
                ends = [(b, s.infos) for b, s in zip(branch_envs, scored)]
                terms = await continuations.team_terms(agent, round_, ends)
            except Exception as exc:  # as a failed call: this task leaves the batch
                result.error = f"{type(exc).__name__}: {exc}"
                return result
        turn = _record_turn(result, scored, terms, this_round, agent, policy_of, round_)

        # The winning branch already holds the committed state: swap it in, replay nothing.
        best = choose(scored, select_by)
        if best in turn:  # the viewer marks the branch that continued (samples.jsonl)
            turn[best].meta["continued"] = True
        env, branch_envs[best] = branch_envs[best], env
        infos = scored[best].infos
        for name, reward in scored[best].rewards.items():
            totals[name] += reward
        this_round.commit(agent, scored[best].rewards)

    regroup(result.samples, task_id, group_by)  # rollout.group_by (grouping.py)
    result.paired_calls = continuations.calls
    return _outcome(result, env, totals)


def _record_turn(
    result: TaskRollout,
    scored: list[Scored],
    terms: list[float | None],
    this_round: RoundCredit,
    agent: str,
    policy_of: Callable[[str], str],
    round_: int,
) -> dict[int, Sample]:
    """Every candidate of the turn as a sample (those with tokens), by its index k."""
    turn: dict[int, Sample] = {}
    for k, s in enumerate(scored):
        result.completion_tokens += len(s.reply.token_ids)
        _keep_captured(result, s.infos.get(agent, {}), s.reward, round_)
        if s.reply.token_ids and s.reply.prompt_token_ids:
            turn[k] = _sample(s, agent, policy_of, result.task_id, round_, result.seed)
            turn[k].meta["choice"] = k  # the call's k-th candidate
            result.samples.append(turn[k])
            this_round.add(agent, turn[k], own_continuation=terms[k])
    return turn


def _outcome(result: TaskRollout, env: MASEnv, totals: dict[str, float]) -> TaskRollout:
    """The committed path's (or the episode's) outcome, onto `result`."""
    result.success = bool(env.state.success)
    result.metrics = env.episode_metrics()
    result.rounds = env.round
    result.rewards = dict(totals)
    return result


class RoundCredit:
    """The paper's r_i = alpha * r_team + r_loc for every agent, within one round.

    A committed step pays the team term it decides (`reward_weights.team * team`) to every
    live agent (the env's rewards). The acting agent has it in its own reward; every other
    agent's samples of this round get it here, whether it acted before the step (plan-path's
    tool, before the plan) or acts after it (code's tester, after the coder), and keep it in
    `meta["team_term"]`. In a tree it is one constant for all K candidates of such an agent
    (only the committed path reached or left that step), so it moves no advantage
    (docs/training.md); across independent trajectories it differs, and counts. Paired
    credit gives each candidate of an earlier agent its own continuation's term instead."""

    def __init__(self) -> None:
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        self.pending: dict[str, float] = defaultdict(float)  # paid before the agent acted
        self.paired: set[str] = set()  # credited by their own continuations this round

    def clear(self) -> None:
        self.samples.clear()
        self.pending.clear()
        self.paired.clear()

    def add(self, agent: str, sample: Sample, own_continuation: float | None = None) -> None:
        """`own_continuation`: the team term candidate's own continuation paid it (paired
        credit); the committed path's later steps then pay this agent nothing."""
        if self.pending[agent]:
            _add_team_term(sample, self.pending[agent])
        if own_continuation is None:
            self.samples[agent].append(sample)
        else:
            self.paired.add(agent)
            _add_team_term(sample, own_continuation)

    def commit(self, acting: str, rewards: dict[str, float]) -> None:
        for other, term in rewards.items():
            if other == acting or not term or other in self.paired:
                continue
            if self.samples[other]:
                for sample in self.samples[other]:
                    _add_team_term(sample, term)
            else:
                self.pending[other] += term


def _add_team_term(sample: Sample, term: float) -> None:
    sample.reward += term
    sample.meta["team_term"] = sample.meta.get("team_term", 0.0) + term


def team_term_metrics(samples: list[Sample]) -> dict[str, float]:
    """`train/team_term/<agent>`: the mean team term later steps added to that agent's
    samples (an acting agent's own step's team term is already in its env reward)."""
    per_agent: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        per_agent[s.agent].append(s.meta.get("team_term", 0.0))
    return {f"train/team_term/{a}": sum(v) / len(v) for a, v in sorted(per_agent.items())}


def call_seed(sample_seed: int | None, rollout_id: str, round_: int, agent: str) -> int | None:
    """The sampling seed of one turn's call: a fixed function of the run's seed, the rollout
    (step and task) and the turn, in 31 bits as every backend takes it; None: unseeded.

    A rerun, or a resumed run, asks for the same candidates; the engine then samples them
    bit-identically where it is batch-invariant, and alike in practice elsewhere."""
    if sample_seed is None:
        return None
    key = f"{sample_seed}:{rollout_id}:{round_}:{agent}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 1


def paired_seed(
    sample_seed: int | None, rollout_id: str, round_: int, k: int, actor: str
) -> int | None:
    """The seed of `actor`'s call in the paired continuation of branch k (`call_seed`)."""
    return call_seed(sample_seed, f"{rollout_id}/paired{k}", round_, actor)


def _play(branch: MASEnv, snapshot: Snapshot, agent: str, reply: Reply) -> Scored:
    branch.restore(snapshot)
    _, rewards, _, _, infos = branch.step({agent: reply.text})
    return Scored(reply, rewards[agent], infos[agent]["reward_parts"]["team"], rewards, infos)


def _keep_captured(result: TaskRollout, info: dict[str, Any], reward: float, round_: int) -> None:
    result.captured += info.get("captured", [])
    if "design_id" in info:
        keys = ("design_id", "design", "error", "executions", "graph")
        record = {k: info.get(k) for k in keys}
        result.designs.append(
            {"task_id": result.task_id, "round": round_, "reward": reward, **record}
        )


def _sample(
    s: Scored,
    agent: str,
    policy_of: Callable[[str], str],
    task_id: str,
    round_: int,
    seed: int,
) -> Sample:
    reply = s.reply
    logprobs = reply.logprobs if len(reply.logprobs) == len(reply.token_ids) else []
    return Sample(
        prompt_token_ids=reply.prompt_token_ids,
        completion_token_ids=reply.token_ids,
        behavior_logprobs=logprobs,
        agent=agent,
        policy=policy_of(agent),
        group=tree_group(task_id, round_, agent),
        reward=s.reward,
        meta={
            "call_id": reply.call_id,
            "seed": seed,
            "round": round_,
            "reward_parts": s.infos.get(agent, {}).get("reward_parts"),
        },
        sampling=reply.sampling,
    )


async def collect_tree_batch(
    make_env: Callable[[], MASEnv],
    seeds: list[int],
    policy: ChatPolicy,
    *,
    branches: int,
    policy_of: Callable[[str], str],
    select_by: Literal["team", "agent"] = "agent",
    rollout_prefix: str = "train",
    concurrency: int = 8,
    sample_seed: int | None = None,
    group_by: GroupBy = "turn_agent",
    team_credit: TeamCredit = "committed",
) -> list[TaskRollout]:
    """Tree rollouts of many tasks in flight at once (the backend batches their calls);
    `sample_seed` seeds every call (see `call_seed`)."""
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
                sample_seed=sample_seed,
                group_by=group_by,
                team_credit=team_credit,
            )

    return await asyncio.gather(*(one(s) for s in seeds))


# ---------------------------------------------------------------------------------------------
# Baselines without a tree (rollout.mode: trajectory, no_tree): K independent episodes per task.
# ---------------------------------------------------------------------------------------------


async def trajectory_rollout(
    make_env: Callable[[], MASEnv],
    seed: int,
    policy: ChatPolicy,
    *,
    episode: int,
    policy_of: Callable[[str], str],
    group_by: GroupBy = "turn_agent",
    rollout_id: str,
    reset_options: dict[str, Any] | None = None,
    sample_seed: int | None = None,
) -> TaskRollout:
    """Episode `episode` of task `seed`: every agent answers once per turn (n=1) and plays on.

    Every call is a sample, in `group_by`'s group (trainer/rollout/grouping.py). Its reward is
    the agent's mixed reward of that turn (with the team term later agents' steps pay, see
    `RoundCredit`), or, when the group pools rounds ('agent', 'task'), the agent's episode
    return, shared by all its calls (GRPO on whole trajectories). The K episodes of a task
    fill the groups.
    """
    env = make_env()
    _, infos = env.reset(seed=seed, options=reset_options)
    task_id = f"{env.name}:{seed}"
    result = TaskRollout(task_id=task_id, seed=seed)
    totals: dict[str, float] = defaultdict(float)
    this_round = RoundCredit()
    while env.agents:
        agent, round_ = env.acting, env.round
        if env.turn == 0:
            this_round.clear()
        try:
            turn_seed = call_seed(sample_seed, rollout_id, round_, agent)
            extra = {} if turn_seed is None else {"seed": turn_seed}
            replies = await policy.act(rollout_id, agent, infos[agent]["messages"], n=1, **extra)
        except Exception as exc:  # a failed call drops this episode, not the run
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        if not replies:
            result.error = f"the policy returned no answer for {agent!r}"
            return result
        reply = replies[0]
        _, rewards, _, _, infos = await asyncio.to_thread(env.step, {agent: reply.text})
        played = Scored(reply, rewards[agent], infos[agent]["reward_parts"]["team"], rewards, infos)
        result.completion_tokens += len(reply.token_ids)
        _keep_captured(result, infos.get(agent, {}), played.reward, round_)
        if reply.token_ids and reply.prompt_token_ids:
            sample = _sample(played, agent, policy_of, task_id, round_, seed)
            sample.meta["episode"] = episode
            sample.meta["rollout_id"] = rollout_id  # each episode is its own rollout
            result.samples.append(sample)
            this_round.add(agent, sample)
        for name, reward in rewards.items():
            totals[name] += reward
        this_round.commit(agent, rewards)

    if spans_turns(group_by):  # one outcome per agent and episode, on every call it made
        for sample in result.samples:
            sample.reward = totals[sample.agent]
    regroup(result.samples, task_id, group_by)
    return _outcome(result, env, totals)


def keep_last_turn(episodes: list[TaskRollout]) -> None:
    """`rollout.mode: no_tree`, the authors' protocol, on the K episodes of one task: only the
    samples of the task's last turn train (`last_turn_only`, per policy), each with its
    turn's reward, in one group per task and policy. The episodes' outcomes stay as played."""
    kept = {id(s) for s in last_turn_only([s for e in episodes for s in e.samples])}
    for e in episodes:
        e.samples = [s for s in e.samples if id(s) in kept]
        regroup(e.samples, e.task_id, "task")


async def collect_trajectory_batch(
    make_env: Callable[[], MASEnv],
    seeds: list[int],
    policy: ChatPolicy,
    *,
    branches: int,
    policy_of: Callable[[str], str],
    group_by: GroupBy = "turn_agent",
    no_tree: bool = False,
    rollout_prefix: str = "train",
    concurrency: int = 8,
    sample_seed: int | None = None,
    reset_options: dict[str, Any] | None = None,
) -> list[TaskRollout]:
    """`branches` (K) independent episodes of every task, one `TaskRollout` each, in (task,
    episode) order; `concurrency` tasks in flight, each with its K episodes at once.
    `no_tree`: the authors' protocol (`keep_last_turn`), whatever `group_by` says."""
    limit = asyncio.Semaphore(concurrency)

    async def task(seed: int) -> list[TaskRollout]:
        async with limit:
            episodes = await asyncio.gather(
                *(
                    trajectory_rollout(
                        make_env,
                        seed,
                        policy,
                        episode=k,
                        policy_of=policy_of,
                        group_by="turn_agent" if no_tree else group_by,
                        rollout_id=f"{rollout_prefix}-{seed}-e{k}",
                        reset_options=reset_options,
                        sample_seed=sample_seed,
                    )
                    for k in range(branches)
                )
            )
        if no_tree:
            keep_last_turn(episodes)
        return episodes

    per_task = await asyncio.gather(*(task(s) for s in seeds))
    return [r for results in per_task for r in results]
