"""Samples from calls an env made itself: auto-MAS's executor, reached through the endpoint.

An env whose agents act inside a step (`env.callers`) reports each such run in
`infos[agent]["captured"]`: its rollout id, the agent, its reward and the design it ran.
Every call recorded under those rollout ids becomes a sample with that reward. Groups:
`question` puts all executions of a task's designs in one group per (task, agent), so an
execution is judged against every design's runs of the same question; `design` groups
the N executions of one design (task, agent, design).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from masenvs.adapters.frameworks.calls import read_calls
from masenvs.traces import TraceStore
from masenvs.trainer.samples import Sample, call_samples

CallerGroup = Literal["question", "design"]


def captured_samples(
    store: TraceStore,
    captured: Sequence[dict[str, Any]],
    *,
    task_of: dict[str, str],
    policy_of: Callable[[str], str],
    group_by: CallerGroup = "question",
    since: float | None = None,
) -> list[Sample]:
    """One sample per sampled choice of every call of the captured runs.

    `task_of` maps each run's rollout id to its task id (the group's first key).
    """
    runs = {c["rollout_id"]: c for c in captured}
    samples = []
    for call in read_calls(store, list(runs), since=since):
        run = runs[call.rollout_id or ""]
        if not call.prompt_token_ids:
            continue
        task = task_of[run["rollout_id"]]
        agent = run["agent"]
        if group_by == "design":
            group: tuple[Any, ...] = ("caller", task, agent, run["design_id"])
        else:
            group = ("caller", task, agent)
        samples += call_samples(
            call,
            agent=agent,
            policy=policy_of(agent),
            group=group,
            reward=float(run["reward"]),
            meta={
                "call_id": call.id,
                "rollout_id": call.rollout_id,
                "design_id": run.get("design_id"),
                "step": call.step,
                "policy_version": call.policy_version,
            },
        )
    return samples


def write_designs(path: Path, step: int, records: Sequence[dict[str, Any]]) -> None:
    """Append each design of a step (code, graph, executions, reward) to `designs.jsonl`."""
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({"step": step, **record}) + "\n")
