"""Rollout workers as Ray actors: env episodes run in other processes, on this node or others.

Each step's task seeds are split into one contiguous share per worker. A worker plays its
share exactly as the trainer would in-process (`collect_tree_batch`, `run_episodes`), sampling
through the capture endpoint's URL, so every call lands in the endpoint's one trace store and
the results come back as the same `TaskRollout`s. A worker that dies or outlives
`distributed.worker_timeout` is killed and replaced; its share is re-run on the new worker
(`on_worker_failure: retry`) or recorded as dropped (`drop`), up to `max_worker_restarts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from masenvs.adapters.episodes import EpisodeResult, run_episodes
from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import with_endpoint
from masenvs.engine.protocol import honours_seed
from masenvs.registry import make
from masenvs.traces import EpisodeRecord
from masenvs.trainer.config import DistributedConfig, TrainConfig
from masenvs.trainer.rollout.grouping import GroupBy
from masenvs.trainer.rollout.paired_credit import TeamCredit
from masenvs.trainer.rollout.ray_cluster import WorkerError, ray_reason, reachable_url, start_ray
from masenvs.trainer.rollout.tree import TaskRollout, collect_trajectory_batch, collect_tree_batch
from masenvs.trainer.samples import Sample

if TYPE_CHECKING:
    from masenvs.adapters.frameworks.clients import ClientSettings
    from masenvs.adapters.frameworks.workflow import WorkflowRun, WorkflowSpec
    from masenvs.adapters.stack import Stack

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a worker needs to play episodes: plain data, sent once when it starts."""

    env_name: str
    env_options: dict[str, Any]  # already pointed at `root_url` for envs that call the model
    root_url: str  # the capture endpoint, reachable from the worker's node
    # The endpoint's key reaches the worker only in this spec, through Ray: never on a
    # command line, and never in a repr that a log could print.
    api_key: str = field(repr=False)
    sampling: Sampling = field(default_factory=Sampling)
    agent_sampling: dict[str, Sampling] = field(default_factory=dict)
    policies: dict[str, str] = field(default_factory=dict)  # agent -> the policy it trains
    branches: int = 1
    select_by: Literal["team", "agent"] = "agent"
    concurrency: int = 8  # tasks in flight in this worker
    sample_seed: int | None = None  # seeds tree sampling's calls (rollout.call_seed)
    mode: Literal["tree", "trajectory", "no_tree"] = "tree"  # rollout.mode: what `tree()` plays
    group_by: GroupBy = "turn_agent"  # rollout.group_by
    team_credit: TeamCredit = "committed"  # rollout.team_credit
    request_timeout: float = 600.0  # backend.request_timeout: seconds one policy call may take
    workflow: WorkflowSpec | None = None  # workflow mode: the program runs in the worker
    # The trainer's working directory and import path, where they exist on the worker's node:
    # user programs (workflow factories, env packages) import as they do in the trainer.
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))


class RolloutWorker:
    """One worker process (a Ray actor): plays the tasks it is given against the endpoint."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        if os.path.isdir(spec.cwd):
            os.chdir(spec.cwd)
        sys.path += [p for p in spec.sys_path if p not in sys.path and os.path.isdir(p)]
        if spec.workflow is None:  # a missing env or package fails at start
            make(spec.env_name, **spec.env_options)
        self._policy: ChatPolicy | None = None  # built on the actor's event loop

    def pid(self) -> int:
        return os.getpid()

    def _chat(self) -> ChatPolicy:
        if self._policy is None:
            s = self.spec
            self._policy = ChatPolicy(
                s.root_url,
                api_key=s.api_key,
                sampling=s.sampling,
                agent_sampling=s.agent_sampling,
                timeout=s.request_timeout,
            )
        return self._policy

    async def tree(self, prefix: str, seeds: list[int]) -> list[TaskRollout]:
        """Training rollouts of `seeds` as in-process: tree rollouts (ids `{prefix}-{seed}`),
        or K independent episodes per seed in trajectory and no_tree modes
        (`{prefix}-{seed}-e{k}`)."""
        s = self.spec
        if s.mode in ("trajectory", "no_tree"):
            return await collect_trajectory_batch(
                lambda: make(s.env_name, **s.env_options),
                seeds,
                self._chat(),
                branches=s.branches,
                policy_of=s.policies.__getitem__,
                group_by=s.group_by,
                no_tree=s.mode == "no_tree",
                rollout_prefix=prefix,
                concurrency=s.concurrency,
                sample_seed=s.sample_seed,
            )
        return await collect_tree_batch(
            lambda: make(s.env_name, **s.env_options),
            seeds,
            self._chat(),
            branches=s.branches,
            policy_of=s.policies.__getitem__,
            select_by=s.select_by,
            rollout_prefix=prefix,
            concurrency=s.concurrency,
            sample_seed=s.sample_seed,
            group_by=s.group_by,
            team_credit=s.team_credit,
        )

    async def workflow(
        self, prefix: str, seeds: list[int], branches: int, settings: ClientSettings
    ) -> list[tuple[WorkflowRun, EpisodeRecord | None]]:
        """K runs of the workflow program per seed, with the episode record of each run (the
        trainer writes it; its calls are in the endpoint's store already)."""
        from masenvs.adapters.frameworks.workflow import run_tasks

        s = self.spec
        assert s.workflow is not None
        records = _Records()
        runs = await run_tasks(
            s.workflow,
            root_url=s.root_url,
            env_name=s.env_name,
            seeds=seeds,
            branches=branches,
            env_options=s.env_options,
            settings=settings,
            store=records,  # type: ignore[arg-type]  # only .append is used
            prefix=prefix,
            concurrency=s.concurrency,
        )
        by_id = {r.rollout_id: r for r in records}
        return [(run, by_id.get(run.rollout_id)) for run in runs]

    async def episodes(
        self, prefix: str, seeds: list[int], sampling: Sampling, agents: dict[str, Sampling]
    ) -> list[EpisodeResult]:
        """Independent episodes (validation) at `sampling`; the trainer records them."""
        s = self.spec
        policy = ChatPolicy(
            s.root_url,
            api_key=s.api_key,
            sampling=sampling,
            agent_sampling=agents,
            timeout=s.request_timeout,
        )
        try:
            return await run_episodes(
                s.env_name,
                policy,
                seeds,
                env_config=s.env_options,
                concurrency=s.concurrency,
                rollout_prefix=prefix,
            )
        finally:
            await policy.aclose()


class _Records(list):
    """Stands in for the trace store in a worker: keeps the episode records to send back."""


def worker_spec(
    cfg: TrainConfig,
    stack: Stack,
    policy: ChatPolicy,
    policies: dict[str, str],
    env_options: dict[str, Any],
) -> WorkerSpec:
    """The spec of a training run's workers: the trainer's sampling settings and env options,
    the stack's endpoint as workers reach it, `rollout.concurrency` split over them."""
    url = reachable_url(stack.root_url)
    return WorkerSpec(
        env_name=cfg.env.name,
        env_options=with_endpoint(cfg.env.name, env_options, url, stack.api_key),
        root_url=url,
        api_key=policy.api_key,
        sampling=policy.sampling,
        agent_sampling=policy.agent_sampling,
        policies=policies,
        branches=cfg.rollout.branches,
        select_by=cfg.rollout.select_by,
        concurrency=math.ceil(cfg.rollout.concurrency / cfg.distributed.rollout_workers),
        sample_seed=cfg.sample_seed if honours_seed(stack.backend) else None,
        mode=cfg.rollout.mode,
        group_by=cfg.rollout.group_by,
        team_credit=cfg.rollout.team_credit,
        request_timeout=cfg.backend.request_timeout,
    )


def workflow_worker_spec(cfg: TrainConfig, stack: Stack) -> WorkerSpec:
    """The spec of workers that run `cfg.workflow`'s program against the stack's endpoint."""
    return WorkerSpec(
        env_name=cfg.env.name,
        env_options=dict(cfg.env.options),
        root_url=reachable_url(stack.root_url),
        api_key=stack.api_key or "masenvs",
        concurrency=math.ceil(cfg.rollout.concurrency / cfg.distributed.rollout_workers),
        workflow=cfg.workflow,
        request_timeout=cfg.backend.request_timeout,
    )


async def collect_workflow(
    pool: RolloutPool,
    stack: Stack,
    *,
    step: int,
    seeds: list[int],
    branches: int,
    settings: ClientSettings,
    policy_of: Callable[[str], str],
) -> tuple[list[Sample], list[WorkflowRun]]:
    """`collect_workflow_samples` with the runs on `pool`'s workers: the trainer sets the
    runs' metadata, writes their episode records and reads their calls from its store."""
    from masenvs.adapters.frameworks.calls import read_calls
    from masenvs.adapters.frameworks.workflow import task_env_options
    from masenvs.trainer.rollout.workflow import workflow_samples

    spec, store, endpoint = pool.spec.workflow, stack.store, stack.endpoint
    assert spec is not None and store is not None, "workflow runs need the endpoint's store"
    env = make(pool.spec.env_name, **task_env_options(pool.spec.env_options)).name
    prefix = f"s{step}"
    for seed in seeds:
        for k in range(branches):
            meta = {"task_id": f"{env}:{seed}", "seed": seed, "run_index": k}
            endpoint.set_rollout_metadata(f"{prefix}-{seed}-{k}", meta)
    started = time.time()
    pairs = await asyncio.to_thread(pool.workflow, prefix, seeds, branches, settings)
    runs = [run for run, _ in pairs]
    for run, record in pairs:
        endpoint.end_rollout(run.rollout_id, refuse_late_calls=True)
        if record is not None:
            record.policy_version = endpoint.policy_version
            store.append(record)
    calls = read_calls(store, [r.rollout_id for r in runs], since=started)
    return workflow_samples(runs, calls, policy_of, spec.agent_of), runs


def shares(seeds: Sequence[int], n: int) -> list[list[int]]:
    """`seeds` in at most `n` contiguous, non-empty shares of near-equal size, in order."""
    n = max(1, min(n, len(seeds)))
    size, extra = divmod(len(seeds), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(list(seeds[start:end]))
        start = end
    return out


@dataclass
class StepReport:
    """What went wrong with the workers during one call: for metrics and the log."""

    dropped: int = 0  # tasks recorded as dropped (on_worker_failure: drop)
    retried: int = 0  # tasks re-run on a new worker (retry)
    failures: list[str] = field(default_factory=list)


class RolloutPool:
    """`distributed.rollout_workers` Ray actors and the step-by-step dispatch over them.

    Starts a small local Ray instance when `ray_address` is None and Ray is not running yet,
    joins the cluster at `ray_address` otherwise; `close()` kills the actors and leaves Ray
    (only if this pool connected to it).
    """

    def __init__(self, spec: WorkerSpec, dist: DistributedConfig) -> None:
        import ray

        if dist.rollout_workers < 1:
            raise ValueError("a RolloutPool needs distributed.rollout_workers >= 1")
        self.spec, self.dist = spec, dist
        self.restarts = 0  # over the run; more than dist.max_worker_restarts stops it
        self.last = StepReport()
        # Called with the workers right after a step's shares are sent (tests kill one there).
        self.after_submit: Callable[[list[Any]], None] | None = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            start_ray(dist)
        self._actor = ray.remote(RolloutWorker).options(
            num_cpus=1,
            max_restarts=0,  # this pool replaces dead workers itself, and counts them
            scheduling_strategy="SPREAD",  # one per node first, when there are several
        )
        self.workers: list[Any] = []
        try:
            self.workers = [self._actor.remote(spec) for _ in range(dist.rollout_workers)]
            self.pids = self._call_all("pid", timeout=dist.worker_timeout)
        except BaseException:
            self.close()
            raise

    def _call_all(self, method: str, *, timeout: float) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote() for w in self.workers]
        try:
            return ray.get(refs, timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            raise WorkerError(
                f"the rollout workers did not start within {timeout:.0f}s ({ray_reason(exc)}); "
                "check that masenvs and the env's packages are installed on every Ray node "
                "and that the cluster has a free CPU for each worker"
            ) from exc

    def tree(self, prefix: str, seeds: list[int]) -> list[TaskRollout]:
        """Tree rollouts of `seeds` over the workers, in seed order (blocking)."""
        env = self.spec.env_name

        def dropped(seed: int, why: str) -> TaskRollout:
            return TaskRollout(task_id=f"{env}:{seed}", seed=seed, error=f"dropped: {why}")

        return self._dispatch("tree", prefix, seeds, (), lambda seed, why: [dropped(seed, why)])

    def episodes(
        self, prefix: str, seeds: list[int], sampling: Sampling, agents: dict[str, Sampling]
    ) -> list[EpisodeResult]:
        """Independent episodes of `seeds` over the workers, in seed order (blocking)."""
        env = self.spec.env_name

        def dropped(seed: int, why: str) -> EpisodeResult:
            rid = f"{prefix}-dropped-{seed}"
            return EpisodeResult(rid, env, seed, False, 0, {}, 0, 0.0, error=f"dropped: {why}")

        args = (sampling, agents)
        return self._dispatch(
            "episodes", prefix, seeds, args, lambda seed, why: [dropped(seed, why)]
        )

    def workflow(
        self, prefix: str, seeds: list[int], branches: int, settings: ClientSettings
    ) -> list[tuple[WorkflowRun, EpisodeRecord | None]]:
        """K = `branches` workflow runs per seed over the workers, ordered by (seed, run)."""
        from masenvs.adapters.frameworks.workflow import WorkflowRun

        env, reward = self.spec.env_name, self.spec.workflow.failure_reward  # type: ignore[union-attr]

        def dropped(seed: int, why: str) -> list[tuple[WorkflowRun, None]]:
            now = time.time()
            return [  # an id of its own: the dead worker's calls of this run never train
                (
                    WorkflowRun(
                        f"{prefix}-dropped-{seed}-{k}",
                        f"{env}:{seed}",
                        seed,
                        k,
                        reward or 0.0,
                        False,
                        "",
                        f"dropped: {why}",
                        0.0,
                        now,
                        now,
                    ),
                    None,
                )
                for k in range(branches)
            ]

        return self._dispatch("workflow", prefix, seeds, (branches, settings), dropped)

    def _dispatch(
        self,
        method: str,
        prefix: str,
        seeds: list[int],
        args: tuple[Any, ...],
        dropped: Callable[[int, str], list[Any]],
    ) -> list[Any]:
        import ray

        self.last = report = StepReport()
        timeout = self.dist.worker_timeout
        out: dict[int, list[Any]] = {}  # share index -> results
        pending: dict[Any, tuple[int, int, list[int], float]] = {}  # ref -> (share, worker,...)

        def submit(share: int, worker: int, part: list[int], attempt: int) -> None:
            tag = prefix if attempt == 0 else f"{prefix}-retry{attempt}"
            ref = getattr(self.workers[worker], method).remote(tag, part, *args)
            pending[ref] = (share, worker, part, time.monotonic() + timeout)
            attempts[share] = attempt

        attempts: dict[int, int] = {}
        parts = shares(seeds, len(self.workers))
        for i, part in enumerate(parts):
            submit(i, i, part, 0)
        if self.after_submit is not None:
            self.after_submit(list(self.workers))

        while pending:
            wait = max(0.0, min(deadline for *_, deadline in pending.values()) - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if ready:
                share, worker, part, _ = pending.pop(ready[0])
                try:
                    out[share] = ray.get(ready[0], timeout=timeout)
                    continue
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                    why = f"rollout worker {worker} died ({ray_reason(exc)})"
                failed = [(share, worker, part)]
            else:  # every share past its deadline is a hung worker
                now = time.monotonic()
                late = [ref for ref, (*_, deadline) in pending.items() if deadline <= now]
                failed = [pending.pop(ref)[:3] for ref in late]
                why = f"rollout worker did not answer within distributed.worker_timeout={timeout}s"
            for share, worker, part in failed:
                self._replace(worker, why)
                if self.dist.on_worker_failure == "retry":
                    log.warning("%s: re-running its %d task(s) on a new worker", why, len(part))
                    report.retried += len(part)
                    submit(share, worker, part, attempts[share] + 1)
                else:
                    log.warning("%s: its %d task(s) are dropped from this step", why, len(part))
                    report.dropped += len(part)
                    out[share] = [x for seed in part for x in dropped(seed, why)]
                report.failures.append(why)
        return [r for i in range(len(parts)) for r in out[i]]

    def _replace(self, index: int, why: str) -> None:
        """Kill worker `index` (dead or hung) and start another in its place."""
        import ray

        self.restarts += 1
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.workers[index], no_restart=True)
        if self.restarts > self.dist.max_worker_restarts:
            raise WorkerError(
                f"{why}; that is {self.restarts} worker failures in this run, more than "
                f"distributed.max_worker_restarts={self.dist.max_worker_restarts}: see the Ray "
                "worker logs (/tmp/ray/session_latest/logs) or raise the limit"
            )
        self.workers[index] = self._actor.remote(self.spec)

    def metrics(self, prefix: str = "train") -> dict[str, float]:
        """The last call's dropped tasks and the run's worker restarts so far."""
        return {
            f"{prefix}/dropped_tasks": float(self.last.dropped),
            f"{prefix}/retried_tasks": float(self.last.retried),
            "workers/restarts": float(self.restarts),
        }

    def close(self) -> None:
        """Kill the workers and leave Ray if this pool joined or started it."""
        import ray

        for worker in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker, no_restart=True)
        self.workers = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
