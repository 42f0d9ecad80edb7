"""What sudoku's `show_candidates` and `show_empty` add to the prompt: each empty cell with the
digits that fit it, or with a '?'. A board is its rows, 0 for an empty cell."""

from __future__ import annotations

import math


def candidates(board: list[list[int]], r: int, c: int) -> list[int]:
    """The digits that empty cell (r, c) may hold: none of its row, column or box has them."""
    n, b = len(board), math.isqrt(len(board))
    used = set(board[r]) | {board[i][c] for i in range(n)}
    used |= {
        board[i][j]
        for i in range(r // b * b, r // b * b + b)
        for j in range(c // b * b, c // b * b + b)
    }
    return [d for d in range(1, n + 1) if d not in used]


def candidate_lines(board: list[list[int]]) -> list[str]:
    """Each empty cell as a `[row, column, value]` fill with its candidates, e.g.
    'Empty cells as [row, column, value]: [0, 2, 3] (only 3 fits); [1, 1, 2 or 4].' When every
    cell has one candidate, one list in the answer's form: '...: [[0, 2, 3], [1, 1, 4]].'"""
    empty = [
        (r, c, candidates(board, r, c))
        for r, row in enumerate(board)
        for c, v in enumerate(row)
        if v == 0
    ]
    if not empty:
        return []
    if all(len(digits) == 1 for _, _, digits in empty):
        fills = ", ".join(f"[{r}, {c}, {digits[0]}]" for r, c, digits in empty)
        return [f"Empty cells as [row, column, value], only one digit fits each: [{fills}]."]
    cells = []
    for r, c, digits in empty:
        if len(digits) == 1:
            cells.append(f"[{r}, {c}, {digits[0]}] (only {digits[0]} fits)")
        else:
            options = " or ".join(map(str, digits)) or "nothing fits: a digit is wrong"
            cells.append(f"[{r}, {c}, {options}]")
    return ["Empty cells as [row, column, value]: " + "; ".join(cells) + "."]


def empty_line(board: list[list[int]]) -> list[str]:
    """The empty cells as fills with '?' for the digit, e.g.
    'Empty cells as [row, column, value]: [[3, 0, ?], [1, 2, ?]].'"""
    cells = [f"[{r}, {c}, ?]" for r, row in enumerate(board) for c, v in enumerate(row) if v == 0]
    return [f"Empty cells as [row, column, value]: [{', '.join(cells)}]."] if cells else []
