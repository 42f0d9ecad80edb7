"""The run pages' charts: metric curves (one series per run x key) and per-agent behaviour."""

from __future__ import annotations

import math
import re
from typing import Any

from masenvs.ui.runs import Run, step_stats

# (title, metric key patterns); {agent} is each agent, {policy} each learner policy.
CURVES: list[tuple[str, list[str]]] = [
    ("success", ["train/success", "val/success"]),
    ("reward", ["train/reward/{agent}", "val/reward/{agent}"]),
    ("loss", ["learner/{policy}/loss"]),
    ("grad norm", ["learner/{policy}/grad_norm"]),
    ("learning rate", ["learner/{policy}/lr", "learner/lr"]),
    ("tokens/s", ["learner/tokens_per_s", "throughput/rollout_tokens_per_s"]),
]


def _matching(records: list[dict[str, Any]], pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern] if any(pattern in r for r in records) else []
    head, _, tail = re.split(r"(\{\w+\})", pattern, maxsplit=1)
    keys = {k for r in records for k in r}
    out = []
    for k in sorted(keys):
        if k.startswith(head) and k.endswith(tail) and len(k) > len(head) + len(tail):
            middle = k[len(head) : len(k) - len(tail)] if tail else k[len(head) :]
            if "/" not in middle:
                out.append(k)
    return out


def curves(runs: list[Run], several: bool) -> list[dict[str, Any]]:
    """uPlot-ready charts: per family, one series per run x metric key, aligned on steps."""
    charts = []
    for title, patterns in CURVES:
        series: list[tuple[str, dict[int, float]]] = []
        for run in runs:
            records = run.metrics()
            for pattern in patterns:
                for key in _matching(records, pattern):
                    points = {
                        r["step"]: r[key]
                        for r in records
                        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
                    }
                    if points:
                        label = key if not several else f"{run.id}: {key}"
                        series.append((label, points))
        if not series:
            continue
        steps = sorted({s for _, points in series for s in points})
        charts.append(
            {
                "title": title,
                "x": steps,
                "series": [
                    {"label": label, "values": [points.get(s) for s in steps]}
                    for label, points in series
                ],
            }
        )
    return charts


def behaviour(run: Run) -> list[dict[str, Any]]:
    """Per agent over steps: answer length, format-failure rate, and how often the agent's
    candidates disagree on the team outcome (its output changes what the team gets)."""
    stats = step_stats(run)
    steps = sorted({step for step, _ in stats})
    seen = {agent for _, agent in stats}
    agents = [a for a in run.agents() if a in seen]  # the run's own order

    def chart(title: str, key: str) -> dict[str, Any] | None:
        series = []
        for agent in agents:
            line = [(stats.get((s, agent)) or {}).get(key) for s in steps]
            if any(v is not None for v in line):
                series.append({"label": agent, "values": line})
        return {"title": title, "x": steps, "series": series} if series else None

    changes = chart("output changes the team outcome (share of groups)", "changes")
    if changes is not None:
        changes["note"] = CHANGES_NOTE
    charts = [chart("answer length (tokens)", "length"), chart("format-failure rate", "failed")]
    return [c for c in [*charts, changes] if c is not None]


CHANGES_NOTE = (
    "Of the agent's groups, the share whose K candidates led to different team rewards. "
    "0 is no verdict on the agent: its candidates all led to the same team outcome (all "
    "right, all wrong, or the team is decided at a later step), so its choice did not change "
    "what the team got this step; its own reward still trains it."
)
