"""Eval report pages: every policy's episodes of one task side by side, and role swaps."""

from __future__ import annotations

import json
from typing import Any

from masenvs.ui.runs import EvalReport, preview


def eval_task_view(report: EvalReport, task_id: str | None) -> dict[str, Any]:
    """Every policy's episodes of one task side by side (each agent's calls and outcome)."""
    tasks: list[str] = []
    for policy in report.policies:
        for r in policy.index.query("SELECT DISTINCT task_id FROM episodes ORDER BY rowid"):
            if r["task_id"] not in tasks:
                tasks.append(r["task_id"])
    task_id = task_id if task_id in tasks else (tasks[0] if tasks else None)
    columns = []
    for policy in report.policies:
        episodes = policy.index.query(
            "SELECT rollout_id, success, rewards, error FROM episodes WHERE task_id = ? "
            "ORDER BY rollout_id",
            (task_id,),
        )
        for e in episodes:
            e["rewards"] = json.loads(e["rewards"] or "{}")
            e["calls"] = policy.index.query(
                "SELECT id, agent, call_index, previews FROM calls WHERE rollout_id = ? "
                "ORDER BY started_at",
                (e["rollout_id"],),
            )
            for c in e["calls"]:
                c["preview"] = preview(c.pop("previews"), 0)
        columns.append({"policy": policy, "episodes": episodes})
    return {"tasks": tasks, "task_id": task_id, "columns": columns}


def swap_results(report: EvalReport, reports: list[EvalReport]) -> list[dict[str, Any]]:
    """A role-swap eval beside the same policies unswapped (from any report of the same env
    and tasks, this one included): success with the roles in their own seats and swapped."""
    data = report.data
    out = []
    for result in data.get("results") or []:
        name = str(result.get("name", ""))
        base, sep, _ = name.partition(" swap ")
        if not sep:
            continue
        found = None
        for other in reports:
            if other.data.get("env") != data.get("env") or other.data.get("tasks") != data.get(
                "tasks"
            ):
                continue
            found = next(
                (r for r in other.data.get("results") or [] if r.get("name") == base), None
            )
            if found is not None:
                found = {**found, "report": other.id}
                break
        out.append({"name": name, "policy": base, "swapped": result, "own": found})
    return out
