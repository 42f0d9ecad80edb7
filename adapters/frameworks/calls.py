"""Read back the calls of a few rollouts from a trace store without parsing all of it.

A training run's store grows every step; only segments written to since the rollouts began
(by modification time) can hold their calls, so older segments are skipped unread.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from masenvs.traces import CallRecord, TraceStore

_MTIME_SLACK_S = 2.0  # file systems with coarse timestamps


def read_calls(
    store: TraceStore, rollout_ids: Collection[str], since: float | None = None
) -> list[CallRecord]:
    """Calls of `rollout_ids`, ordered by (rollout, agent, call_index).

    `since` (unix time) skips segments last written before it, and calls that arrived
    before it (a rollout id reused by a resumed run); give the time the rollouts started.
    Without it every segment is read.
    """
    wanted = set(rollout_ids)
    if not wanted:
        return []
    calls = []
    for segment in store.segments():
        if since is not None and _mtime(segment) < since - _MTIME_SLACK_S:
            continue
        for data in _lines(segment):
            if data.get("type") != "call" or data.get("rollout_id") not in wanted:
                continue
            if since is not None and data.get("started_at", 0.0) < since:
                continue
            calls.append(CallRecord.from_dict(data))
    calls.sort(key=lambda c: (c.rollout_id or "", c.agent, c.call_index))
    return calls


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _lines(segment: Path) -> list[dict]:
    out = []
    try:
        with open(segment, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a record still being written (or torn by a killed writer)
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
