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

from masenvs.adapters.episodes import EpisodeResult, run_episodes
from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import Stack, start_stack
from masenvs.traces import TraceStore
from masenvs.trainer.config import DistributedConfig, TrainConfig, load_config
from masenvs.trainer.rollout.ray_cluster import WorkerError, reachable_url, start_ray
from masenvs.trainer.rollout.sources import env_factory, env_options
from masenvs.trainer.rollout.tree import TaskRollout, collect_trajectory_batch, collect_tree_batch
from masenvs.trainer.rollout.workers import RolloutPool, shares, worker_spec
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train

AGENTS = {"plan": "plan", "tool": "tool"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # 4 logical CPUs (a worker takes 1): the shared pool and one more pool of 2 at a time.
    ray.init(
        num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
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


@pytest.fixture(scope="module")
def workers(cluster: None, stack: Stack) -> Iterator[RolloutPool]:
    """Two greedy workers shared by the tests; failure tests set their own `dist` and hook."""
    cfg = config("distributed.rollout_workers=2", "distributed.max_worker_restarts=100")
    shared = pool(stack, cfg)
    yield shared
    shared.close()


def failing(workers: RolloutPool, **dist: Any) -> RolloutPool:
    """`workers` with these `distributed.*` settings for the failure tests."""
    base = {"rollout_workers": 2, "max_worker_restarts": 100}
    workers.dist = DistributedConfig(**{**base, **dist})
    return workers


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
    stack: Stack, workers: RolloutPool
) -> None:
    seeds = list(range(100, 106))
    local = asyncio.run(in_process(stack, config(), seeds))
    remote = workers.tree("remote", seeds)
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


def test_workers_play_the_in_process_validation_episodes(
    stack: Stack, workers: RolloutPool
) -> None:
    cfg = config()
    seeds, greedy = [7, 8, 9], Sampling(0.0, 1.0, 0, 8, seed=0)

    async def local() -> list[EpisodeResult]:
        policy = greedy_policy(stack)
        try:
            return await run_episodes("plan_path", policy, seeds, env_config=env_options(cfg))
        finally:
            await policy.aclose()

    remote = workers.episodes("val", seeds, greedy, {})
    expected = asyncio.run(local())
    assert [(r.seed, r.rewards, r.actions) for r in remote] == [
        (r.seed, r.rewards, r.actions) for r in expected
    ]
    assert all(r.actions and r.error is None for r in remote)


@pytest.mark.parametrize("mode", ["retry", "drop"])
def test_a_worker_killed_mid_step_costs_a_retry_or_its_tasks_not_the_run(
    stack: Stack, workers: RolloutPool, mode: str
) -> None:
    failing(workers, on_worker_failure=mode)
    seeds, restarts = list(range(200, 206)), workers.restarts
    try:
        first = seeds[:3]  # worker 0's share
        workers.after_submit = kill_when_busy(stack, f"{mode}1", first, signal.SIGKILL)
        results = workers.tree(f"{mode}1", seeds)
        assert [r.seed for r in results] == seeds
        assert workers.restarts == restarts + 1
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
        workers.after_submit = None


def test_a_hung_worker_is_killed_after_worker_timeout(stack: Stack, workers: RolloutPool) -> None:
    failing(workers, on_worker_failure="drop", worker_timeout=5)
    seeds = list(range(300, 304))
    hook = kill_when_busy(stack, "hung", seeds[:2], signal.SIGSTOP)  # alive, never answers
    workers.after_submit = hook
    try:
        started = time.monotonic()
        results = workers.tree("hung", seeds)
        assert time.monotonic() - started < 30
        assert [bool(r.error) for r in results] == [True, True, False, False]
        assert "worker_timeout=5.0" in results[0].error
        deadline = time.monotonic() + 20
        while _alive(hook.pid):  # killed, not left stopped
            assert time.monotonic() < deadline, "the hung worker was left running"
            time.sleep(0.1)
    finally:
        workers.after_submit = None


def test_more_failures_than_max_worker_restarts_stop_the_run(cluster: None, stack: Stack) -> None:
    cfg = config("distributed.rollout_workers=2", "distributed.max_worker_restarts=0")
    workers = pool(stack, cfg)
    workers.after_submit = lambda w: ray.kill(w[1], no_restart=True)
    handles = list(workers.workers)
    try:
        with pytest.raises(WorkerError, match="max_worker_restarts=0"):
            workers.tree("limit", list(range(400, 404)))
    finally:
        workers.close()
    with pytest.raises(ray.exceptions.RayActorError):  # close() killed the workers
        ray.get(handles[0].pid.remote(), timeout=30)


def test_training_with_two_workers_finishes_and_records_no_failure(
    cluster: None, tmp_path: Path
) -> None:
    cfg = config(
        f"run_dir={tmp_path}",
        "steps=2",
        "rollout.tasks_per_step=4",
        "validation.every=2",
        "validation.episodes=2",
        "logging.tensorboard=false",
        "lora.rank=4",
        "backend.dtype=float32",
        "distributed.rollout_workers=2",
        # Ray is up (the fixture), so this joins it: the endpoint listens on all interfaces
        # and the workers reach it at this node's IP address, as they would from other nodes.
        "distributed.ray_address=auto",
    )
    train(cfg, console=Console(quiet=True))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/success" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/dropped_tasks"] == 0 and r["workers/restarts"] == 0 for r in steps)
    assert all(
        r["train/failed_tasks"] == 0 and r["train/completion_tokens/plan"] > 0 for r in steps
    )
    assert [r["step"] for r in rows if "val/success" in r] == [0, 2]
    # Every call went through the endpoint, and validation episodes were recorded by the trainer.
    store = TraceStore(tmp_path / "traces")
    assert {c.rollout_id.split("-")[0] for c in store.calls()} == {"s1", "s2", "val0", "val2"}
    assert len(list(store.episodes())) == 4


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_each_worker_gets_a_contiguous_share_of_the_seeds() -> None:
    assert shares(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert shares([5], 4) == [[5]]  # fewer tasks than workers: idle workers, no empty share


def test_a_wildcard_endpoint_is_reached_at_this_nodes_address() -> None:
    ip = ray.util.get_node_ip_address()
    assert reachable_url("http://0.0.0.0:8123") == f"http://{ip}:8123"
    assert reachable_url("http://127.0.0.1:8123") == "http://127.0.0.1:8123"


def test_the_example_joins_a_cluster_and_runs_locally_with_one_override() -> None:
    path = Path(__file__).parent.parent / "examples" / "distributed.yaml"
    cfg = load_config(path)
    assert (cfg.distributed.ray_address, cfg.distributed.rollout_workers) == ("auto", 4)
    assert load_config(path, ["distributed.ray_address=null"]).distributed.ray_address is None


def test_workflow_programs_run_on_the_workers_and_train_from_the_endpoints_store(
    cluster: None, tmp_path: Path
) -> None:
    """A LangGraph program (solver, then critic k+1 times) runs in the workers; its calls are
    read back from the trainer's trace store as samples, as in-process."""
    cfg = config(
        f"run_dir={tmp_path}",
        "steps=1",
        "env.name=math",
        "env.options={level: 1}",
        "rollout.tasks_per_step=2",
        "rollout.concurrency=4",
        "validation.every=0",
        "logging.tensorboard=false",
        "lora.rank=4",
        "backend.dtype=float32",
        "distributed.rollout_workers=2",
        "workflow.factory=workflow_programs:langgraph_steps",
        "workflow.framework=langgraph",
        "workflow.agents=[solver, critic]",
    )
    train(cfg, console=Console(quiet=True))
    store = TraceStore(tmp_path / "traces")
    calls = list(store.calls())
    runs = {f"s1-{seed}-{k}" for seed in (0, 1) for k in (0, 1)}
    assert {c.rollout_id for c in calls} == runs
    episodes = list(store.episodes())
    assert {e.rollout_id for e in episodes} == runs
    assert all(e.policy_version == 0 and e.extra["error"] is None for e in episodes)
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["train/dropped_tasks"] == 0 and row["train/failed_runs"] == 0
    for agent in ("solver", "critic"):  # every call of the agent is a sample
        assert row[f"learner/{agent}/samples"] == sum(c.agent == agent for c in calls)


def test_a_cluster_nobody_runs_fails_at_once_naming_the_fix() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"ray_address='127.0.0.1:1'.*ray start --head"):
        start_ray(DistributedConfig(rollout_workers=1, ray_address="127.0.0.1:1"))
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("mode", ["trajectory", "no_tree"])
def test_workers_play_trajectory_mode_as_in_process(cluster: None, stack: Stack, mode: str) -> None:
    """rollout.mode=trajectory (and no_tree) on the workers: K independent episodes per task,
    the same rollouts (temperature 0) as collect_trajectory_batch in the trainer's process."""
    cfg = config("distributed.rollout_workers=2", f"rollout.mode={mode}")
    seeds = [200, 201, 202]
    workers = pool(stack, cfg)
    try:
        remote = workers.tree("traj", seeds)
    finally:
        workers.close()

    async def local() -> list[TaskRollout]:
        policy = greedy_policy(stack)
        try:
            return await collect_trajectory_batch(
                env_factory(cfg, stack),
                seeds,
                policy,
                branches=2,
                policy_of=AGENTS.__getitem__,
                no_tree=mode == "no_tree",
                rollout_prefix="traj-local",
            )
        finally:
            await policy.aclose()

    here = asyncio.run(local())
    assert [(r.seed, r.error) for r in remote] == [(s, None) for s in seeds for _ in (0, 1)]
    for a, b in zip(here, remote, strict=True):
        assert (a.task_id, a.success, a.rounds, a.rewards) == (
            b.task_id,
            b.success,
            b.rounds,
            b.rewards,
        )
        assert [(s.group, s.reward, s.meta["episode"]) for s in a.samples] == [
            (s.group, s.reward, s.meta["episode"]) for s in b.samples
        ]
    if mode == "no_tree":  # the task's last turn only, one group per task and policy
        assert any(r.samples for r in remote)
        assert all(s.group == (r.task_id, s.policy) for r in remote for s in r.samples)
    traced = {c.rollout_id for c in stack.store.calls() if c.rollout_id.startswith("traj-")}
    assert {f"traj-{s}-e{k}" for s in seeds for k in (0, 1)} <= traced
