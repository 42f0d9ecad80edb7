"""Episodes of an env played by a `ChatPolicy`: one (`run_episode`) or many at once
(`run_episodes`, with progress), each an `EpisodeResult`, optionally recorded in a trace store.

The library behind `masenvs rollout` (adapters/rollout.py), `masenvs eval` and the trainer's
trajectory and validation episodes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import Progress

from masenvs.adapters.policy import ChatPolicy
from masenvs.env import MASEnv
from masenvs.registry import make
from masenvs.traces import EpisodeRecord, TraceStore


def phase_status(console: Console, text: str) -> Any:
    """A spinner on a terminal; in a log, the phase's line now, timestamped (a log is never
    silent for the minutes a model takes to load on a CPU)."""
    if not console.is_terminal:
        console.print(f"{time.strftime('%H:%M:%S')} {text}")
    return console.status(text)


@dataclass
class EpisodeResult:
    rollout_id: str
    env: str
    seed: int
    success: bool
    rounds: int
    rewards: dict[str, float]  # summed over rounds, per agent
    completion_tokens: int
    seconds: float
    error: str | None = None  # why the episode stopped early, if it did
    actions: list[dict[str, str]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # env.episode_metrics()


def new_rollout_id(prefix: str = "ro") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def run_episode(
    env: MASEnv,
    policy: ChatPolicy,
    seed: int,
    *,
    rollout_id: str | None = None,
    store: TraceStore | None = None,
    options: dict[str, Any] | None = None,
    on_turn: Callable[[int], None] | None = None,
) -> EpisodeResult:
    """One episode: at each turn the acting agent answers its prompt and the env plays it, so
    a later agent's prompt shows what earlier agents did this round (sequential turns)."""
    rollout_id = rollout_id or new_rollout_id()
    started = time.perf_counter()
    _, infos = env.reset(seed=seed, options=options)
    totals: dict[str, float] = defaultdict(float)
    tokens, error = 0, None
    actions_log: list[dict[str, str]] = []  # one dict per round, agents in turn order
    while env.agents:
        agent, round_ = env.acting, env.round
        try:
            reply = (await policy.act(rollout_id, agent, infos[agent]["messages"]))[0]
        except Exception as exc:  # an unreachable backend ends this episode, not the run
            error = f"{type(exc).__name__}: {exc}"
            break
        tokens += reply.completion_tokens
        if on_turn is not None:  # progress per call: an episode can take minutes on a CPU
            on_turn(reply.completion_tokens)
        if len(actions_log) <= round_:
            actions_log.append({})
        actions_log[round_][agent] = reply.text
        # Env steps may run sandboxed programs: keep them off the event loop.
        _, rewards, _, _, infos = await asyncio.to_thread(env.step, {agent: reply.text})
        for name, reward in rewards.items():
            totals[name] += reward
    result = EpisodeResult(
        rollout_id=rollout_id,
        env=env.name,
        seed=seed,
        success=bool(env.state.success),
        rounds=env.round,
        rewards=dict(totals),
        completion_tokens=tokens,
        seconds=time.perf_counter() - started,
        error=error,
        actions=actions_log,
        metrics=env.episode_metrics(),
    )
    if store is not None:
        store.append(episode_record(result))
    return result


def episode_record(result: EpisodeResult) -> EpisodeRecord:
    """The trace store's record of an episode (written here, or by the trainer for a worker's)."""
    return EpisodeRecord(
        rollout_id=result.rollout_id,
        task_id=f"{result.env}:{result.seed}",
        env=result.env,
        rewards=result.rewards,
        success=result.success,
        extra={
            "rounds": result.rounds,
            "seed": result.seed,
            "error": result.error,
            **({"metrics": result.metrics} if result.metrics else {}),
        },
    )


async def run_episodes(
    env_name: str,
    policy: ChatPolicy,
    seeds: list[int],
    *,
    env_config: dict[str, Any] | None = None,
    store: TraceStore | None = None,
    concurrency: int = 8,
    progress: Progress | None = None,
    rollout_prefix: str = "ro",
) -> list[EpisodeResult]:
    """Many episodes in flight at once; the backend batches their calls. `progress` counts
    turns (calls), each episode's budget being max_rounds x agents, less what an episode
    that ends early leaves, so its ETA is right from the first call."""
    limit = asyncio.Semaphore(concurrency)
    probe = make(env_name, **(env_config or {}))
    budget = probe.config.max_rounds * len(probe.possible_agents)
    started = time.perf_counter()
    count: dict[str, Any] = {
        "episodes": 0,
        "tokens": 0,
        "total": budget * len(seeds),
        "printed": started,
    }
    task_id = (
        progress.add_task(_described(env_name, count, len(seeds)), total=count["total"])
        if progress
        else None
    )

    def on_turn(tokens: int) -> None:
        count["tokens"] += tokens
        if progress is None:
            return
        progress.update(task_id, advance=1, description=_described(env_name, count, len(seeds)))
        now = time.perf_counter()
        if not progress.console.is_terminal and now - count["printed"] >= 30.0:
            count["printed"] = now  # a log gets a line every 30 s, between episodes too
            progress.console.print(_calls_line(env_name, count, started, progress, task_id))

    async def one(seed: int) -> EpisodeResult:
        async with limit:
            env = make(env_name, **(env_config or {}))
            rollout_id = new_rollout_id(rollout_prefix)
            result = await run_episode(
                env, policy, seed, rollout_id=rollout_id, store=store, on_turn=on_turn
            )
            count["episodes"] += 1
            if progress is not None:
                turns = sum(len(r) for r in result.actions)
                count["total"] -= budget - turns  # an episode that ended early
                progress.update(
                    task_id,
                    total=count["total"],
                    description=_described(env_name, count, len(seeds)),
                )
                if not progress.console.is_terminal:  # a log gets one line per episode
                    progress.console.print(
                        _episode_line(result, count, len(seeds), started, progress, task_id)
                    )
            return result

    return await asyncio.gather(*(one(s) for s in seeds))


def _described(env_name: str, count: dict[str, Any], episodes: int) -> str:
    return f"{env_name}: episodes {count['episodes']}/{episodes}, {count['tokens']} tokens, calls"


def _calls_line(
    env_name: str, count: dict[str, Any], started: float, progress: Progress, task_id: Any
) -> str:
    """`sudoku: calls 24/64, 1210 tokens, 20 tok/s, 60 s, ETA 100 s`."""
    seconds = time.perf_counter() - started
    task = next((t for t in progress.tasks if t.id == task_id), None)
    done = int(task.completed) if task is not None else 0
    left = seconds / done * (count["total"] - done) if done else 0.0
    return (
        f"{env_name}: calls {done}/{count['total']}, {count['tokens']} tokens, "
        f"{count['tokens'] / max(seconds, 1e-9):.0f} tok/s, {seconds:.0f} s, ETA {left:.0f} s"
    )


def _episode_line(
    result: EpisodeResult,
    count: dict[str, Any],
    episodes: int,
    started: float,
    progress: Progress,
    task_id: Any,
) -> str:
    """`episode 3/8 (seed 2): success, 2 rounds, 96 tokens, 41 s, 61 tok/s, ETA 1 min 20 s`."""
    seconds = time.perf_counter() - started
    task = next((t for t in progress.tasks if t.id == task_id), None)
    eta = ""
    if task is not None and task.completed and task.total:
        left = seconds / task.completed * (task.total - task.completed)
        eta = f", ETA {left:.0f} s"
    return (
        f"episode {count['episodes']}/{episodes} (seed {result.seed}): "
        f"{'success' if result.success else 'no success'}, {result.rounds} rounds, "
        f"{result.completion_tokens} tokens, {seconds:.0f} s, "
        f"{count['tokens'] / max(seconds, 1e-9):.0f} tok/s{eta}"
    )
