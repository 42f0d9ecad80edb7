"""Training samples from framework workflows: K runs per task, grouped (task, agent, call).

A workflow cannot be branched like an env, so its groups are the same call of K independent
runs of one task (DESIGN.md): the i-th call of agent `a` in every run of task `t` forms group
(t, a, i). Each call is one sample and trains with its run's episode reward; a run that made
fewer calls simply has no member in the later groups (a group of one has advantage 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from masenvs.adapters.frameworks.calls import read_calls
from masenvs.adapters.frameworks.clients import ClientSettings
from masenvs.adapters.frameworks.workflow import Factory, WorkflowRun, WorkflowSpec, run_tasks
from masenvs.traces import CallRecord, TraceStore
from masenvs.trainer.samples import Sample, workflow_group


def workflow_samples(
    runs: Sequence[WorkflowRun],
    calls: Sequence[CallRecord],
    policy_of: Callable[[str], str] | None = None,
) -> list[Sample]:
    """One sample per sampled choice of every call the runs made.

    `policy_of(agent)` names the adapter a sample trains; without it, the adapter the
    endpoint served the call with (`CallRecord.model`).
    """
    by_rollout = {run.rollout_id: run for run in runs}
    samples = []
    for call in calls:
        run = by_rollout.get(call.rollout_id or "")
        if run is None or not call.prompt_token_ids:
            continue
        if run.ended_at and call.started_at > run.ended_at:
            continue  # a late call of a timed-out run, whose thread went on: never trained
        for choice in call.choices:
            logprobs = choice.logprobs if len(choice.logprobs) == len(choice.token_ids) else []
            samples.append(
                Sample(
                    prompt_token_ids=list(call.prompt_token_ids),
                    completion_token_ids=list(choice.token_ids),
                    behavior_logprobs=list(logprobs),
                    agent=call.agent,
                    policy=policy_of(call.agent) if policy_of else call.model,
                    group=workflow_group(run.task_id, call.agent, call.call_index),
                    reward=run.reward,
                    meta={
                        "call_id": call.id,
                        "rollout_id": run.rollout_id,
                        "seed": run.seed,
                        "run_index": run.run_index,
                        "call_index": call.call_index,
                        "served_by": call.model,
                        "policy_version": call.policy_version,
                        "failed": run.error is not None,
                    },
                )
            )
    return samples


async def collect_workflow_samples(
    spec: WorkflowSpec,
    *,
    root_url: str,
    store: TraceStore,
    env_name: str,
    seeds: list[int],
    runs_per_task: int,
    env_options: dict[str, Any] | None = None,
    settings: ClientSettings | None = None,
    policy_of: Callable[[str], str] | None = None,
    endpoint: Any = None,
    step: int = 0,
    concurrency: int = 8,
    factory: Factory | None = None,
) -> tuple[list[Sample], list[WorkflowRun]]:
    """Run every task `runs_per_task` times and read their calls back as samples.

    `store` must be the endpoint's trace store (the calls are read from it); rollout ids
    are `s{step}-{seed}-{k}`. `factory` overrides `spec.factory` (a function, not a path).
    """
    started = time.time()
    runs = await run_tasks(
        spec,
        root_url=root_url,
        env_name=env_name,
        seeds=seeds,
        runs_per_task=runs_per_task,
        env_options=env_options,
        settings=settings,
        store=store,
        endpoint=endpoint,
        prefix=f"s{step}",
        concurrency=concurrency,
        factory=factory,
    )
    calls = read_calls(store, [r.rollout_id for r in runs], since=started)
    return workflow_samples(runs, calls, policy_of), runs


def workflow_metrics(runs: Sequence[WorkflowRun], samples: Sequence[Sample]) -> dict[str, float]:
    """Run-level numbers worth logging (`sample_metrics` has rewards and lengths per agent)."""
    n = max(len(runs), 1)
    out: dict[str, float] = {
        "train/success": sum(r.success for r in runs) / n,
        "train/reward": sum(r.reward for r in runs) / n,
        "train/failed_runs": float(sum(r.error is not None for r in runs)),
        "time/run_s": sum(r.seconds for r in runs) / n,
    }
    for agent in sorted({s.agent for s in samples}):
        out[f"train/calls_per_run/{agent}"] = sum(s.agent == agent for s in samples) / n
    return out
