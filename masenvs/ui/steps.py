"""A training step's page: each task's turns as a tree of K candidates, and its groups."""

from __future__ import annotations

import json
from typing import Any

from masenvs.ui.diagnosis import reward_terms
from masenvs.ui.runs import Run, preview


def step_view(run: Run, step: int) -> dict[str, Any]:
    """The step's tasks, each with its turns (tree) and its caller groups."""
    rows = run.index.query(
        "SELECT s.*, c.rollout_id AS call_rollout, c.previews, c.finish_reason "
        "FROM samples s LEFT JOIN calls c ON c.id = s.call_id "
        "WHERE s.step = ? ORDER BY s.seq",
        (step,),
    )
    tasks: dict[str, dict[str, Any]] = {}
    for r in rows:
        r["parts"] = json.loads(r["parts"] or "null") or {}
        r["group"] = json.loads(r["grp"] or "null")
        r["rollout"] = r["rollout_id"] or r["call_rollout"]
        r["preview"] = preview(r.pop("previews", None), r["choice"])
        r["terms"] = reward_terms(run, r)
        task = tasks.setdefault(r["task_id"], {"task_id": r["task_id"], "groups": {}})
        group = task["groups"].setdefault(
            r["grp"],
            {
                "key": r["group"],
                "agent": r["agent"],
                "round": r["round"],
                "caller": bool(r["group"]) and r["group"][0] == "caller",
                "label": group_label(r["group"], r["round"]),
                "members": [],
            },
        )
        group["members"].append(r)
    out = []
    for task in tasks.values():
        groups = list(task["groups"].values())
        for g in groups:
            rewards = [m["reward"] for m in g["members"]]
            g["mean"] = sum(rewards) / len(rewards)
            g["drop"] = next((m["drop_reason"] for m in g["members"] if m["drop_reason"]), None)
            g["kept"] = all(m["kept"] for m in g["members"])
            # all K rewards equal: every advantage is 0, whether or not the group was kept
            g["flat"] = max(rewards) - min(rewards) < 1e-9
        turns = [g for g in groups if not g["caller"] and g["round"] is not None]
        others = [g for g in groups if g not in turns]
        out.append(
            {
                "task_id": task["task_id"],
                "turns": turns,
                "others": others,
                "tree": tree_layout(turns),
            }
        )
    return {"tasks": out, "samples": len(rows)}


def group_label(key: Any, round_: int | None) -> str:
    """What a group is, from its key (trainer/samples.py): a tree turn's round, a workflow's
    n-th call of an agent (at a named step), an agent's whole episodes, or captured calls."""
    key = key if isinstance(key, list) else []
    if key and key[0] == "caller":
        return "captured"
    if round_ is not None:
        return f"round {round_}"
    if len(key) == 3 and isinstance(key[2], int):  # (task, agent, call_index)
        return f"call {key[2]}"
    if len(key) == 4 and isinstance(key[3], int):  # (task, agent, step, call_index)
        return f"call {key[3]} @{key[2]}"
    return "episode"


BOX_W, BOX_H, GAP_X, GAP_Y = 150, 58, 14, 34


def tree_layout(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """SVG geometry of a task's tree: one row per turn, its K candidates side by side, edges
    from the candidate that continued to every candidate of the next turn."""
    boxes, edges = [], []
    width = 0
    parent: tuple[float, float] | None = None
    for row, turn in enumerate(turns):
        y = 20 + row * (BOX_H + GAP_Y)
        continued = None
        for k, m in enumerate(turn["members"]):
            x = 10 + k * (BOX_W + GAP_X)
            boxes.append({"x": x, "y": y, "m": m, "turn": turn})
            if parent is not None:
                edges.append((parent[0], parent[1], x + BOX_W / 2, y))
            if m["continued"]:
                continued = (x + BOX_W / 2, y + BOX_H)
            width = max(width, x + BOX_W + 10)
        parent = continued
    height = 20 + len(turns) * (BOX_H + GAP_Y)
    return {
        "boxes": boxes,
        "edges": edges,
        "width": width,
        "height": height,
        "w": BOX_W,
        "h": BOX_H,
    }
