"""Auto-MAS designs (graph and executions) and captured program runs (calls per agent lane)."""

from __future__ import annotations

import math
import re
from typing import Any

from masenvs.ui.runs import Run, preview


def design_view(run: Run, design_id: str) -> dict[str, Any] | None:
    rows = run.index.query("SELECT * FROM designs WHERE design_id = ? LIMIT 1", (design_id,))
    if not rows:
        return None
    record = run.index.record(rows[0]) or {}
    graph = record.get("graph") or {"structure": "", "nodes": [], "edges": []}
    calls = {}
    for node in graph.get("nodes", []):
        ids = [c for c in node.get("calls") or [] if c]  # '': a call the gate refused
        found = []
        for cid in ids:
            meta = run.index.query(
                "SELECT id, rollout_id, agent, previews FROM calls WHERE id = ?", (cid,)
            )
            if meta:
                meta[0]["preview"] = preview(meta[0].pop("previews"), 0)
            found.append(meta[0] if meta else {"id": cid, "rollout_id": None, "preview": ""})
        calls[node["name"]] = found
    # each execution's calls, by rollout id mas-{design_id}-{m}
    executions = []
    for m, e in enumerate(record.get("executions") or []):
        rollout = f"mas-{design_id}-{m}"
        n = run.index.query("SELECT COUNT(*) AS n FROM calls WHERE rollout_id = ?", (rollout,))
        executions.append({"m": m, "rollout": rollout, "calls": n[0]["n"], **e})
    return {
        "record": record,
        "graph": graph,
        "layout": graph_layout(graph),
        "calls": calls,
        "executions": executions,
    }


def graph_layout(graph: dict[str, Any]) -> dict[str, Any]:
    """Nodes on a circle, clockwise from the top in declaration order (as `mas-graph` draws)."""
    nodes = graph.get("nodes") or []
    n = max(len(nodes), 1)
    cx, cy, r = 260, 200, 150 if n > 1 else 0
    pos = {}
    for i, node in enumerate(nodes):
        pos[node["name"]] = (
            cx + r * math.sin(2 * math.pi * i / n),
            cy - r * math.cos(2 * math.pi * i / n),
        )
    edges = []
    for a, b in graph.get("edges") or []:
        if a in pos and b in pos and a != b:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            d = math.hypot(x2 - x1, y2 - y1) or 1.0
            shrink = 42
            edges.append(
                (
                    x1 + (x2 - x1) * shrink / d,
                    y1 + (y2 - y1) * shrink / d,
                    x2 - (x2 - x1) * shrink / d,
                    y2 - (y2 - y1) * shrink / d,
                )
            )
    return {
        "nodes": [
            {
                "name": node["name"],
                "x": pos[node["name"]][0],
                "y": pos[node["name"]][1],
                "calls": len([c for c in node.get("calls") or [] if c]),
            }
            for node in nodes
        ],  # fmt: skip
        "edges": edges,
        "width": 520,
        "height": 400,
    }


def rollout_view(run: Run, rollout_id: str) -> dict[str, Any]:
    """A captured program run: its calls in time order, one lane per agent, and its outcome."""
    calls = run.index.query(
        "SELECT id, agent, call_index, step_name, started_at, latency_s, previews, "
        "finish_reason, completion_tokens FROM calls WHERE rollout_id = ? ORDER BY started_at",
        (rollout_id,),
    )
    for c in calls:
        c["preview"] = preview(c.pop("previews"), 0)
    episodes = run.index.query("SELECT * FROM episodes WHERE rollout_id = ?", (rollout_id,))
    episode = None
    if episodes:
        episode = run.index.record(episodes[-1])
    lanes = list(dict.fromkeys(c["agent"] for c in calls))
    w, h, gx, gy = 150, 46, 30, 22
    boxes = []
    for i, c in enumerate(calls):
        lane = lanes.index(c["agent"])
        boxes.append({"x": 110 + i * (w + gx), "y": 16 + lane * (h + gy), "c": c, "n": i})
    edges = [(a["x"] + w, a["y"] + h / 2, b["x"], b["y"] + h / 2) for a, b in zip(boxes, boxes[1:])]
    layout = {
        "boxes": boxes,
        "edges": edges,
        "lanes": [{"name": a, "y": 16 + i * (h + gy)} for i, a in enumerate(lanes)],
        "width": 120 + len(calls) * (w + gx),
        "height": 24 + len(lanes) * (h + gy),
        "w": w,
        "h": h,
    }
    return {"calls": calls, "episode": episode, "layout": layout}


def workflow_runs(run: Run, step: int | None = None) -> list[dict[str, Any]]:
    """The episodes of captured program runs (workflow mode), newest step first."""
    rows = run.index.query(
        "SELECT e.rollout_id, e.task_id, e.success, e.rewards, e.error, "
        "(SELECT COUNT(*) FROM calls c WHERE c.rollout_id = e.rollout_id) AS calls "
        "FROM episodes e ORDER BY e.created_at"
    )
    out = []
    for r in rows:
        m = re.match(r"^s(\d+)-", r["rollout_id"] or "")
        r["step"] = int(m.group(1)) if m else None
        if step is None or r["step"] == step:
            out.append(r)
    return out
