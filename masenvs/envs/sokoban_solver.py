"""Sokoban's searches: a shortest solution of a level (breadth-first over player and boxes), and
the reverse play from the solved room that task generation starts levels from."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from masenvs.envs import grid
from masenvs.envs.grid import Cell
from masenvs.envs.sokoban_level import SokobanTask


@dataclass
class SearchResult:
    moves: str | None  # a shortest solution, or None
    exhausted: bool  # True: the whole state space was searched (None then means unsolvable)


def solve(task: SokobanTask, max_states: int = 100_000) -> SearchResult:
    """Breadth-first search over (player, boxes) for a shortest move sequence."""
    start = (task.player, frozenset(task.boxes))
    if task.solved(start[1]):
        return SearchResult("", True)
    parent: dict[tuple[Cell, frozenset[Cell]], tuple[Any, str]] = {start: (None, "")}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        for move in "UDLR":
            nxt = grid.step_cell(player, move)
            if not task.is_floor(nxt):
                continue
            new_boxes = boxes
            if nxt in boxes:
                beyond = grid.step_cell(nxt, move)
                if not task.is_floor(beyond) or beyond in boxes or beyond in task.dead:
                    continue
                new_boxes = (boxes - {nxt}) | {beyond}
            child = (nxt, new_boxes)
            if child in parent:
                continue
            parent[child] = (state, move)
            if task.solved(new_boxes):
                path = []
                while parent[child][0] is not None:
                    child, step = parent[child]
                    path.append(step)
                return SearchResult("".join(reversed(path)), True)
            if len(parent) > max_states:
                return SearchResult(None, False)
            queue.append(child)
    return SearchResult(None, True)


def reverse_play(room: SokobanTask, max_states: int) -> dict[tuple[Cell, frozenset[Cell]], int]:
    """Every state reachable backwards from the solved room, with its distance to a solution.

    Breadth-first from all solved states (boxes on goals, player anywhere): a reverse step is a
    player move that may pull the box behind it. Undoing it is a legal forward move, so each
    distance is the exact length of a shortest solution, also when `max_states` stops early.
    """
    boxes = frozenset(room.goals)
    floor = [(r, c) for r, row in enumerate(room.layout) for c, ch in enumerate(row) if ch != "#"]
    depth = {(p, boxes): 0 for p in floor if p not in boxes}
    queue = deque(depth)
    while queue and len(depth) < max_states:
        state = queue.popleft()
        player, boxes = state
        for move in "UDLR":
            nxt = grid.step_cell(player, move)
            if not room.is_floor(nxt) or nxt in boxes:
                continue
            behind = (2 * player[0] - nxt[0], 2 * player[1] - nxt[1])
            children = [(nxt, boxes)]
            if behind in boxes:
                children.append((nxt, (boxes - {behind}) | {player}))
            for child in children:
                if child not in depth:
                    depth[child] = depth[state] + 1
                    queue.append(child)
    return depth
