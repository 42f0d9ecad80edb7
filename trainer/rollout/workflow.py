"""Training samples from framework workflows: K runs per task, grouped (task, agent, call).

A workflow cannot be branched like an env, so its groups are the same call of K independent
runs of one task (DESIGN.md): the i-th call of agent `a` in every run of task `t` forms group
(t, a, i). Each call is one sample and trains with its run's episode reward; a run that made
fewer calls simply has no member in the later groups (a group of one has advantage 0).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from masenvs.adapters.frameworks.calls import read_calls
from masenvs.adapters.frameworks.clients import ClientSettings, UnknownAgent
from masenvs.adapters.frameworks.factory import Factory
from masenvs.adapters.frameworks.workflow import WorkflowRun, WorkflowSpec, run_tasks
from masenvs.adapters.policy_map import BASE, PolicyMap
from masenvs.traces import CallRecord, TraceStore
from masenvs.trainer.config import ConfigError
from masenvs.trainer.samples import Sample, call_samples, workflow_group


def workflow_samples(
    runs: Sequence[WorkflowRun],
    calls: Sequence[CallRecord],
    policy_of: Callable[[str], str] | None = None,
    agent_of: Callable[[str], str | None] | None = None,
) -> list[Sample]:
    """One sample per sampled choice of every call the runs made.

    `policy_of(agent)` names the adapter a sample trains; without it, the adapter the
    endpoint served the call with (`CallRecord.model`). `agent_of(model name)` is the agent
    a call trains as (`WorkflowSpec.agent_of`); a call it gives None for (an unknown agent
    the base model served) is no sample: no policy made it.
    """
    by_rollout = {run.rollout_id: run for run in runs}
    samples = []
    for call in calls:
        run = by_rollout.get(call.rollout_id or "")
        if run is None or not call.prompt_token_ids:
            continue
        if run.ended_at and call.started_at > run.ended_at:
            continue  # a late call of a timed-out run, whose thread went on: never trained
        agent = agent_of(call.agent) if agent_of else call.agent
        if agent is None:
            continue
        samples += call_samples(
            call,
            agent=agent,
            policy=policy_of(agent) if policy_of else call.model,
            # keyed by the name the program used: a mapped name's calls are other
            # decisions than its agent's, trained by the same policy
            group=workflow_group(run.task_id, call.agent, call.call_index, call.step),
            reward=run.reward,
            meta={
                "call_id": call.id,
                "rollout_id": run.rollout_id,
                "seed": run.seed,
                "run_index": run.run_index,
                "call_index": call.call_index,
                "step": call.step,
                "served_by": call.model,
                "model_name": call.agent,  # what the program asked for
                "policy_version": call.policy_version,
                "failed": run.error is not None,
            },
        )
    return samples


async def collect_workflow_samples(
    spec: WorkflowSpec,
    *,
    root_url: str,
    store: TraceStore,
    env_name: str,
    seeds: list[int],
    branches: int,
    env_options: dict[str, Any] | None = None,
    settings: ClientSettings | None = None,
    policy_of: Callable[[str], str] | None = None,
    endpoint: Any = None,
    step: int = 0,
    concurrency: int = 8,
    factory: Factory | None = None,
    on_run: Callable[[WorkflowRun], None] | None = None,
) -> tuple[list[Sample], list[WorkflowRun]]:
    """Run every task K = `branches` times and read their calls back as samples.

    `store` must be the endpoint's trace store (the calls are read from it); rollout ids
    are `s{step}-{seed}-{k}`. `factory` overrides `spec.factory` (a function, not a path).
    """
    started = time.time()
    runs = await run_tasks(
        spec,
        root_url=root_url,
        env_name=env_name,
        seeds=seeds,
        branches=branches,
        env_options=env_options,
        settings=settings,
        store=store,
        endpoint=endpoint,
        prefix=f"s{step}",
        concurrency=concurrency,
        factory=factory,
        on_run=on_run,
    )
    calls = read_calls(store, [r.rollout_id for r in runs], since=started)
    for run in runs:  # how long its calls took: what a timeout's fix is sized by
        run.call_seconds = [c.latency_s for c in calls if c.rollout_id == run.rollout_id]
    return workflow_samples(runs, calls, policy_of, spec.agent_of), runs


def workflow_policy_map(
    spec: WorkflowSpec,
    served_as: Callable[[str], str],
    chat_template_kwargs: dict[str, dict[str, Any]] | None = None,
) -> PolicyMap:
    """The endpoint's routes for a workflow: each agent (and each `agent_map` name) to the
    model `served_as(agent)`; other names to the base model ('base') or rejected."""
    kwargs = chat_template_kwargs or {}
    names = {**{a: a for a in spec.agents}, **spec.agent_map}
    return PolicyMap(
        {name: served_as(agent) for name, agent in names.items()},
        default=BASE if spec.unknown_agents == "base" else None,
        chat_template_kwargs={n: kwargs[a] for n, a in names.items() if a in kwargs},
        adapters_by_name=False,
        reject_hint=(
            "; add it to workflow.agents, or set workflow.unknown_agents: base (the base model "
            "answers it, never trained) or map (workflow.agent_map: {name: agent})"
        ),
    )


def check_unknown_agents(policy_map: PolicyMap, runs: Sequence[WorkflowRun]) -> None:
    """Stop training when the program used a model name `unknown_agents: reject` refuses."""
    if policy_map.rejected:
        names = ", ".join(sorted(map(repr, policy_map.rejected)))
        known = ", ".join(sorted(policy_map.routes))
        raise UnknownAgentError(
            f"the workflow called model {names}, which is not one of its agents ({known}); "
            "add it to workflow.agents, or set workflow.unknown_agents: base (the base model "
            "answers it, never trained) or map (workflow.agent_map: {name: agent})"
        )
    for run in runs:
        if run.error and run.error.startswith(f"{UnknownAgent.__name__}:"):
            raise UnknownAgentError(f"workflow run {run.rollout_id}: {run.error}")


class UnknownAgentError(ConfigError):
    """The program used a model name the workflow's `unknown_agents` policy rejects."""


def workflow_metrics(runs: Sequence[WorkflowRun], samples: Sequence[Sample]) -> dict[str, float]:
    """Run-level numbers worth logging (`sample_metrics` has rewards and lengths per agent)."""
    from masenvs.trainer.rollout.sources import episode_rates  # sources loads torch: lazily

    n = max(len(runs), 1)
    out: dict[str, float] = {
        "train/success": sum(r.success for r in runs) / n,
        "train/reward": sum(r.reward for r in runs) / n,
        "train/failed_runs": float(sum(r.error is not None for r in runs)),
        "time/run_s": sum(r.seconds for r in runs) / n,
    }
    out |= episode_rates("train", [r.metrics for r in runs]) if runs else {}
    for agent in sorted({s.agent for s in samples}):
        out[f"train/calls_per_run/{agent}"] = sum(s.agent == agent for s in samples) / n
    return out


class TooManyFailures(RuntimeError):
    """More than `workflow.max_failure_rate` of the recent runs failed: training stops."""


class FailureWindow:
    """The outcome of the last `size` runs; `check` stops training when too many failed."""

    def __init__(self, size: int, max_rate: float) -> None:
        self.max_rate = max_rate
        self.errors: deque[str | None] = deque(maxlen=size)
        self.call_seconds: deque[list[float]] = deque(maxlen=size)

    def check(self, runs: Sequence[WorkflowRun]) -> None:
        """Add this step's runs; raise `TooManyFailures` naming the most common reason (and,
        for a timeout, its fix)."""
        self.errors.extend(run.error for run in runs)
        self.call_seconds.extend(run.call_seconds for run in runs)
        failed = [e for e in self.errors if e is not None]
        if not self.errors or len(failed) / len(self.errors) <= self.max_rate:
            return
        reason, count = Counter(failed).most_common(1)[0]
        message = (
            f"stopping: {len(failed)} of the last {len(self.errors)} workflow runs failed "
            f"(more than workflow.max_failure_rate={self.max_rate:g}); most common reason "
            f"({count} runs): {reason}"
        )
        if reason.startswith("ProgramTimeout"):
            seconds = [s for e, c in zip(self.errors, self.call_seconds) if e == reason for s in c]
            message += "; " + timeout_fix(seconds)
        raise TooManyFailures(message)


def timeout_fix(seconds: Sequence[float]) -> str:
    """What to change when runs time out, sized by the calls they made:
    `their 6 LLM calls took 48-61 s each: raise workflow.timeout_s ...`."""
    fix = "raise workflow.timeout_s (--set workflow.timeout_s=...) or lower rollout.max_tokens"
    if not seconds:
        return f"they made no LLM call that finished in time: {fix}, or check the program"
    low, high = min(seconds), max(seconds)
    took = f"{low:.1f} s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} s"
    return f"their {len(seconds)} finished LLM calls took {took} each: {fix}"


def why_no_samples(runs: Sequence[WorkflowRun]) -> str:
    """One line saying why a step's runs gave no training sample."""
    failed = [r.error for r in runs if r.error is not None]
    if runs and len(failed) == len(runs):
        reason, count = Counter(failed).most_common(1)[0]
        return f"all {len(runs)} runs failed before a trainable call ({count}x {reason})"
    return f"the {len(runs)} runs made no call as one of workflow.agents"
