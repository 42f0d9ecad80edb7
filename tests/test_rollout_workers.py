"""Rollout workers as Ray actors: a local Ray cluster on loopback, 2 workers, the tiny model
behind a real capture endpoint. Workers give the trainer the same results as in-process
rollouts, and a worker that dies or hangs mid-step costs its tasks (or a retry), not the run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console

from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import Stack, start_stack
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.metrics import read_metrics
from masenvs.trainer.rollout import TaskRollout, collect_tree_batch
from masenvs.trainer.train import env_factory, env_options, train
from masenvs.trainer.workers import RolloutPool, WorkerError, worker_spec

AGENTS = {"plan": "plan", "tool": "tool"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # 3 logical CPUs: 2 workers and room for a replacement while a killed one is reaped.
    ray.init(
        num_cpus=3, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    served = start_stack(
        model="tiny",
        traces=tmp_path_factory.mktemp("traces"),
        max_batch_size=16,
        dtype="float32",
    )
    yield served
    served.close()


def config(*overrides: str) -> TrainConfig:
    base = ["model.name=tiny", "env.name=plan_path", "env.options={size: 4}"]
    rollout = ["rollout.branches=2", "rollout.max_rounds=2", "rollout.max_tokens=8"]
    return load_config(None, [*base, *rollout, *overrides])


def greedy_policy(stack: Stack) -> ChatPolicy:
    return ChatPolicy(stack.root_url, sampling=Sampling(0.0, 1.0, 0, 8, seed=0))


def pool(stack: Stack, cfg: TrainConfig) -> RolloutPool:
    """Workers that sample greedily, as `greedy_policy` does (the spec copies its settings)."""
    spec = worker_spec(cfg, stack, greedy_policy(stack), AGENTS, env_options(cfg))
    return RolloutPool(spec, cfg.distributed)


async def in_process(stack: Stack, cfg: TrainConfig, seeds: list[int]) -> list[TaskRollout]:
    policy = greedy_policy(stack)
    try:
        return await collect_tree_batch(
            env_factory(cfg, stack),
            seeds,
            policy,
            branches=2,
            policy_of=AGENTS.__getitem__,
            rollout_prefix="local",
        )
    finally:
        await policy.aclose()


def kill_when_busy(stack: Stack, prefix: str, seeds: list[int], sig: int) -> Any:
    """A hook that sends `sig` to worker 0 once one of its rollouts has made a call."""

    def hook(workers: list[Any]) -> None:
        pid = ray.get(workers[0].pid.remote(), timeout=30)
        wanted = {f"{prefix}-{s}" for s in seeds}
        deadline = time.monotonic() + 30
        while not wanted & {c.rollout_id for c in stack.store.calls()}:
            assert time.monotonic() < deadline, "worker 0 never called the endpoint"
            time.sleep(0.05)
        os.kill(pid, sig)
        hook.pid = pid  # type: ignore[attr-defined]

    return hook


def test_workers_return_the_in_process_rollouts_at_temperature_0(
    cluster: None, stack: Stack
) -> None:
    cfg = config("distributed.rollout_workers=2")
    seeds = list(range(100, 106))
    local = asyncio.run(in_process(stack, cfg, seeds))
    workers = pool(stack, cfg)
    handles = list(workers.workers)
    try:
        remote = workers.tree("remote", seeds)
    finally:
        workers.close()
    with pytest.raises(ray.exceptions.RayActorError):  # close() killed the workers
        ray.get(handles[0].pid.remote(), timeout=30)
    assert [r.seed for r in remote] == seeds and not any(r.error for r in remote)
    for a, b in zip(local, remote):
        assert (a.task_id, a.success, a.rounds, a.rewards) == (
            b.task_id,
            b.success,
            b.rounds,
            b.rewards,
        )
        assert len(a.samples) == len(b.samples) > 0
        for x, y in zip(a.samples, b.samples):
            assert x.prompt_token_ids == y.prompt_token_ids
            assert x.completion_token_ids == y.completion_token_ids
            assert (x.group, x.reward, x.agent, x.policy) == (y.group, y.reward, y.agent, y.policy)
            assert x.behavior_logprobs == pytest.approx(y.behavior_logprobs, abs=1e-4)
    # The workers' calls land in the endpoint's one trace store, under their rollout ids.
    traced = {c.rollout_id for c in stack.store.calls() if c.rollout_id.startswith("remote-")}
    assert traced == {f"remote-{s}" for s in seeds}


@pytest.mark.parametrize("mode", ["retry", "drop"])
def test_a_worker_killed_mid_step_costs_a_retry_or_its_tasks_not_the_run(
    cluster: None, stack: Stack, mode: str
) -> None:
    cfg = config("distributed.rollout_workers=2", f"distributed.on_worker_failure={mode}")
    seeds = list(range(200, 206))
    workers = pool(stack, cfg)
    try:
        first = seeds[:3]  # worker 0's share
        workers.after_submit = kill_when_busy(stack, f"{mode}1", first, signal.SIGKILL)
        results = workers.tree(f"{mode}1", seeds)
        assert [r.seed for r in results] == seeds
        assert workers.restarts == 1
        if mode == "retry":
            assert not any(r.error for r in results)
            assert workers.metrics()["train/retried_tasks"] == 3
            assert all(r.samples for r in results)
        else:
            assert [bool(r.error) for r in results] == [True] * 3 + [False] * 3
            assert "rollout worker 0 died" in results[0].error
            assert workers.metrics()["train/dropped_tasks"] == 3
        # The replacement serves the next step.
        workers.after_submit = None
        again = workers.tree(f"{mode}2", seeds)
        assert not any(r.error for r in again) and workers.metrics()["train/dropped_tasks"] == 0
    finally:
        workers.close()


def test_a_hung_worker_is_killed_after_worker_timeout(cluster: None, stack: Stack) -> None:
    cfg = config(
        "distributed.rollout_workers=2",
        "distributed.on_worker_failure=drop",
        "distributed.worker_timeout=8",
    )
    seeds = list(range(300, 304))
    workers = pool(stack, cfg)
    hook = kill_when_busy(stack, "hung", seeds[:2], signal.SIGSTOP)  # alive, never answers
    workers.after_submit = hook
    try:
        started = time.monotonic()
        results = workers.tree("hung", seeds)
        assert time.monotonic() - started < 30
        assert [bool(r.error) for r in results] == [True, True, False, False]
        assert "worker_timeout=8" in results[0].error
        deadline = time.monotonic() + 20
        while _alive(hook.pid):  # killed, not left stopped
            assert time.monotonic() < deadline, "the hung worker was left running"
            time.sleep(0.1)
    finally:
        workers.close()


def test_more_failures_than_max_worker_restarts_stop_the_run(cluster: None, stack: Stack) -> None:
    cfg = config("distributed.rollout_workers=2", "distributed.max_worker_restarts=0")
    workers = pool(stack, cfg)
    workers.after_submit = lambda w: ray.kill(w[1], no_restart=True)
    try:
        with pytest.raises(WorkerError, match="max_worker_restarts=0"):
            workers.tree("limit", list(range(400, 404)))
    finally:
        workers.close()


def test_training_with_two_workers_runs_and_validates_like_in_process(
    cluster: None, tmp_path: Path
) -> None:
    def run(name: str, workers: int) -> list[dict[str, Any]]:
        cfg = config(
            f"run_dir={tmp_path / name}",
            "steps=2",
            "seed=3",
            "rollout.tasks_per_step=4",
            "validation.every=2",
            "validation.episodes=4",
            "logging.tensorboard=false",
            "lora.rank=4",
            "backend.dtype=float32",
            f"distributed.rollout_workers={workers}",
        )
        train(cfg, console=Console(quiet=True))
        return read_metrics(tmp_path / name / "metrics.jsonl")

    remote, local = run("workers", 2), run("local", 0)
    steps = [r for r in remote if "train/success" in r]
    assert len(steps) == 2
    assert all(r["train/dropped_tasks"] == 0 and r["workers/restarts"] == 0 for r in steps)
    assert all(r["train/failed_tasks"] == 0 for r in steps)
    # Greedy validation before training (step 0) sees the same weights: the same episodes.
    before = [r for r in remote if r["step"] == 0][0]
    assert before["val/dropped_tasks"] == 0
    assert {k: before[k] for k in local[0] if k.startswith("val/")} == {
        k: v for k, v in local[0].items() if k.startswith("val/")
    }
    assert "val/success" in local[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
