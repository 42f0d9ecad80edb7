"""Sudoku answers: a grid (rows of digits, a JSON list of rows, a flat list) or `[row, column,
value]` fills, read from the text after the last marker."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from masenvs.parsing import parse_json_list


@dataclass
class SudokuAnswer:
    """A parsed answer: cell writes (row, col, value; 0 clears) and how many entries were bad."""

    fills: list[tuple[int, int, int]]
    dropped: int = 0


_GRID_LINE = re.compile(r"^[\s\d.,|\[\]_+\-*]*$", re.ASCII)
_GRID_CELL = re.compile(r"[\d._*]", re.ASCII)
_DIGITS = re.compile(r"\d{1,3}", re.ASCII)


def parse_answer(text: str, n: int, marker: str = "####") -> SudokuAnswer | None:
    """The grid or fill list after the last `marker` (or anywhere when there is none)."""
    segment = text.rsplit(marker, 1)[1] if marker in text else text
    return _json_answer(segment, n) or _text_grid(segment, n)


def _json_answer(segment: str, n: int) -> SudokuAnswer | None:
    value = parse_json_list(segment)
    if value is None:  # text after the list may hold another bracket: decode from the first [
        start = segment.find("[")
        if start >= 0:
            try:
                value, _ = json.JSONDecoder().raw_decode(segment[start:].replace("'", '"'))
            except (ValueError, RecursionError):
                value = None
    if not isinstance(value, list) or not value:
        return None
    if len(value) == n * n and not any(isinstance(v, list) for v in value):  # a flat grid
        value = [value[r * n : (r + 1) * n] for r in range(n)]
    if len(value) == 3 and all(_as_int(v) is not None for v in value):  # a single fill
        value = [value]
    if not all(isinstance(row, list) for row in value):
        return None
    if len(value) == n and all(len(row) == n for row in value):
        return _grid_answer([[as_cell(v) for v in row] for row in value], n)
    if all(len(row) == 3 for row in value):
        return _fills_answer([tuple(_as_int(v) for v in row) for row in value], n)
    return None


def _text_grid(segment: str, n: int) -> SudokuAnswer | None:
    """The last run of n lines that each hold n digits ('.', '_' or '*' for an empty cell)."""
    run: list[list[int | None]] = []
    best: list[list[int | None]] | None = None
    for line in segment.splitlines():
        if not _GRID_LINE.match(line):
            run = []
            continue
        cells = _GRID_CELL.findall(line)
        if not cells:
            continue  # a separator line such as ------+------
        if len(cells) != n:
            run = []
            continue
        run.append([as_cell(ch) for ch in cells])
        if len(run) >= n:
            best = run[-n:]
    return _grid_answer(best, n) if best is not None else None


def _grid_answer(rows: list[list[int | None]], n: int) -> SudokuAnswer | None:
    return _fills_answer([(r, c, rows[r][c]) for r in range(n) for c in range(n)], n)


def _fills_answer(entries: list[tuple[int | None, ...]], n: int) -> SudokuAnswer | None:
    fills = [
        (r, c, v)
        for r, c, v in entries
        if r is not None and c is not None and v is not None
        if 0 <= r < n and 0 <= c < n and 0 <= v <= n
    ]
    if not fills:
        return None
    return SudokuAnswer(fills, dropped=len(entries) - len(fills))


def _as_int(v: Any) -> int | None:
    """An int from an int, an integral float or a short ASCII digit string; None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and _DIGITS.fullmatch(v.strip()):
        return int(v.strip())
    return None


def as_cell(v: Any) -> int | None:
    """A grid cell: like `_as_int`, with null, "", ".", "_" and "*" meaning empty (0)."""
    if v is None or (isinstance(v, str) and v.strip() in ("", ".", "_", "*")):
        return 0
    return _as_int(v)
