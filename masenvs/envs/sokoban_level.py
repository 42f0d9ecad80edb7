"""A Sokoban level: its walls and goals, the squares a box can never leave alive, and the level
as text. The env, its task generation and its solver all read it."""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from masenvs.envs import grid
from masenvs.envs.grid import Cell


@dataclass(frozen=True)
class SokobanTask:
    layout: tuple[str, ...]  # '#' wall, '_' floor, '.' goal
    boxes: tuple[Cell, ...]  # sorted
    player: Cell
    optimal_moves: int | None = None  # BFS length; None when the search budget ran out
    dead: frozenset[Cell] = field(init=False, repr=False, compare=False)
    goals: frozenset[Cell] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        goals = frozenset(
            (r, c) for r, row in enumerate(self.layout) for c, ch in enumerate(row) if ch == "."
        )
        object.__setattr__(self, "goals", goals)
        object.__setattr__(self, "dead", self._dead_squares())

    @property
    def height(self) -> int:
        return len(self.layout)

    @property
    def width(self) -> int:
        return len(self.layout[0])

    def is_floor(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.height and 0 <= c < self.width and self.layout[r][c] != "#"

    def solved(self, boxes: frozenset[Cell]) -> bool:
        return boxes == self.goals

    def deadlocked(self, boxes: frozenset[Cell]) -> bool:
        return not boxes.isdisjoint(self.dead)

    def potential(self, boxes: frozenset[Cell]) -> float:
        """Minus the sum of each box's Manhattan distance to its nearest goal."""
        return -float(sum(min(grid.manhattan(b, g) for g in self.goals) for b in boxes))

    def _dead_squares(self) -> frozenset[Cell]:
        """Floor cells from which no push can ever bring a box to a goal (walls only).

        A box can reach a goal from exactly the cells a box can be *pulled* to from a goal.
        """
        live, queue = set(self.goals), deque(self.goals)
        while queue:
            box = queue.popleft()
            for move in grid.DELTAS:
                ahead = grid.step_cell(box, move)
                stand = grid.step_cell(ahead, move)
                if self.is_floor(ahead) and self.is_floor(stand) and ahead not in live:
                    live.add(ahead)
                    queue.append(ahead)
        floor = {
            (r, c) for r, row in enumerate(self.layout) for c, ch in enumerate(row) if ch != "#"
        }
        return frozenset(floor - live)

    def rows(self, player: Cell, boxes: frozenset[Cell]) -> list[str]:
        """The level as text: '#' wall, '_' floor, '.' goal, '$' box, '*' box on goal,
        '@' player, '+' player on goal."""
        rows = [list(r) for r in self.layout]
        for r, c in boxes:
            rows[r][c] = "*" if (r, c) in self.goals else "$"
        rows[player[0]][player[1]] = "+" if player in self.goals else "@"
        return ["".join(r) for r in rows]

    @cached_property
    def task_id(self) -> str:
        text = "\n".join(self.rows(self.player, frozenset(self.boxes)))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.rows(self.player, frozenset(self.boxes)),
            "optimal_moves": self.optimal_moves,
        }
