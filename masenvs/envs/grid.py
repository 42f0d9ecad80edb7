"""What the grid tasks share: moves, BFS, text and RGB pictures of a grid."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

Cell = tuple[int, int]

DELTAS: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


def step_cell(cell: Cell, move: str) -> Cell:
    dr, dc = DELTAS[move]
    return cell[0] + dr, cell[1] + dc


def manhattan(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def straight_moves(src: Cell, dst: Cell) -> tuple[str, str]:
    """Where `dst` lies from `src` in words and the straight moves there, rows first:
    ('2 rows down and 1 column left', 'D, D, L'); ('', '') when they are the same cell."""
    dr, dc = dst[0] - src[0], dst[1] - src[1]
    steps = [("row", "down", "D", dr) if dr > 0 else ("row", "up", "U", -dr)]
    steps.append(("column", "right", "R", dc) if dc > 0 else ("column", "left", "L", -dc))
    steps = [s for s in steps if s[3]]
    where = " and ".join(f"{n} {unit}{'s' if n != 1 else ''} {word}" for unit, word, _, n in steps)
    return where, ", ".join(letter for _, _, letter, n in steps for _ in range(n))


def bfs_distances(free: np.ndarray, source: Cell) -> np.ndarray:
    """Shortest move counts from `source` over cells where `free` is True (-1: unreachable)."""
    rows, cols = free.shape
    dist = np.full(free.shape, -1, dtype=np.int64)
    dist[source] = 0
    queue = deque([source])
    while queue:
        cell = queue.popleft()
        for move in DELTAS:
            r, c = step_cell(cell, move)
            if 0 <= r < rows and 0 <= c < cols and free[r, c] and dist[r, c] < 0:
                dist[r, c] = dist[cell] + 1
                queue.append((r, c))
    return dist


def grid_text(rows: Iterable[str]) -> str:
    """A character grid with row and column numbers, as the agents see it."""
    rows = list(rows)
    width = len(rows[0]) if rows else 0
    header = "   " + " ".join(str(c % 10) for c in range(width))
    body = [f"{r:>2} " + " ".join(row) for r, row in enumerate(rows)]
    return "\n".join([header, *body])


# 3x5 bitmap digits for rgb_array renders of numbers (sudoku).
_DIGITS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
}


def render_cells(
    rows: list[str],
    palette: dict[str, tuple[int, int, int]],
    cell: int = 24,
    digit_color: tuple[int, int, int] = (20, 20, 20),
    cell_colors: dict[Cell, tuple[int, int, int]] | None = None,
) -> np.ndarray:
    """An RGB picture (H, W, 3, uint8) of a character grid; digits are drawn as glyphs.

    `cell_colors` overrides the palette's background for single cells (e.g. sudoku clues).
    """
    cell_colors = cell_colors or {}
    height, width = len(rows), len(rows[0])
    image = np.full((height * cell, width * cell, 3), 255, dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, char in enumerate(row):
            top, left = r * cell, c * cell
            background = cell_colors.get((r, c)) or palette.get(char, (255, 255, 255))
            image[top : top + cell, left : left + cell] = background
            if char in _DIGITS:
                _draw_digit(image, char, top, left, cell, digit_color)
    # Thin grid lines make cells countable.
    image[::cell, :, :] = 160
    image[:, ::cell, :] = 160
    return image


def _draw_digit(
    image: np.ndarray, digit: str, top: int, left: int, cell: int, color: tuple[int, int, int]
) -> None:
    scale = max(cell // 8, 1)
    bitmap = np.array([int(b) for b in _DIGITS[digit]], dtype=bool).reshape(5, 3)
    glyph = np.kron(bitmap, np.ones((scale, scale), dtype=bool))
    gh, gw = glyph.shape
    y, x = top + (cell - gh) // 2, left + (cell - gw) // 2
    image[y : y + gh, x : x + gw][glyph] = color
