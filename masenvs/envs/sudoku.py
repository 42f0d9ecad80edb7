"""Sudoku: fill a 4x4 or 9x9 grid so every row, column and box holds each digit once.

Roles (Stronger-MAS), in turn order: `tool` writes Python that solves the puzzle (run in the
sandbox); `plan` then sees the tool's program and its output of the same round and gives the
cells the team commits. Single-agent mode: `plan` alone, which may also write code. Fills
accumulate on the board from round to round.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.envs import grid
from masenvs.envs.sudoku_hints import candidate_lines, empty_line
from masenvs.envs.sudoku_parsing import SudokuAnswer, as_cell, parse_answer
from masenvs.envs.sudoku_solver import solutions
from masenvs.envs.tooling import ToolRun, round_context, run_tool

Board = list[list[int]]  # 0 = empty
DEFAULT_CLUES = {4: 6, 9: 30}


class SudokuConfig(EnvConfig):
    size: Literal[4, 9] = Field(4, description="Grid side: 4 (2x2 boxes) or 9 (3x3 boxes).")
    clues: int | None = Field(
        None,
        ge=0,
        description="Given digits to keep (None: 6 for 4x4, 30 for 9x9). Fewer is harder; "
        "removal stops earlier when the solution would stop being unique.",
    )
    step_cost: float = Field(-0.01, description="Added once per answer.")
    progress: float = Field(0.5, description="Times the change in correct cells / size^2.")
    violation_shaping: float = Field(
        0.02, description="Times the drop in rule violations (repeated digits in a unit)."
    )
    solved_bonus: float = Field(2.0, description="For a complete valid grid that keeps the clues.")
    conflict_penalty: float = Field(
        -0.5, description="When the board after the answer repeats a digit in a row/column/box."
    )
    clue_penalty: float = Field(-0.5, description="When the answer tries to change a given clue.")
    format_penalty: float = Field(
        -1.5,
        description="For an answer with no parsable grid or fills: below a wrong grid's "
        "penalties (conflict + clue), or RL learns to stop its grid early.",
    )
    tool_timeout: float = Field(5.0, gt=0, description="Wall seconds for the tool's program.")
    show_candidates: bool = Field(
        False,
        description="Also list each empty cell's candidates (the digits its row, column and box "
        "do not hold yet) as fills, e.g. '[0, 2, 3] (only 3 fits)' or '[1, 1, 2 or 4]', and ask "
        "for the fills (single-agent mode: the answer alone, no program): the elimination a small "
        "model gets wrong, done for it.",
    )
    show_empty: bool = Field(
        False,
        description="Also list the empty cells in the answer's form with '?' for the digit, "
        "e.g. '[[3, 0, ?], [1, 2, ?]]', and ask for the fills (single-agent mode: the answer "
        "alone, no program): where to answer, not what; the digits stay for the model to find. "
        "With show_candidates, the candidates are listed instead.",
    )

    @model_validator(mode="after")
    def _clues_fit(self) -> SudokuConfig:
        if self.clues is not None and self.clues > self.size * self.size:
            raise ValueError(f"clues={self.clues} exceeds the {self.size}x{self.size} cells")
        return self

    @model_validator(mode="after")
    def _warn_cut_grids(self) -> SudokuConfig:
        """Name the reward hole RL found (docs/learning.md, issue 46): no grid at all must pay
        less than a full grid that rewrites a clue and repeats a digit."""
        wrong = self.conflict_penalty + self.clue_penalty + self.step_cost
        if self.format_penalty >= wrong:
            warnings.warn(
                f"sudoku: format_penalty {self.format_penalty} is not below a wrong grid's "
                f"{wrong:.2f} (conflict + clue penalties + step cost): RL learns to stop its grid "
                "early rather than risk a wrong digit (docs/learning.md); lower format_penalty",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def target_clues(self) -> int:
        return DEFAULT_CLUES[self.size] if self.clues is None else self.clues


# --- reward --------------------------------------------------------------------------------


@dataclass
class FillOutcome:
    """What an answer does to a board (committed for `plan`, simulated for `tool`)."""

    board: Board
    shaping: float  # step cost + progress + violation shaping
    outcome: float  # solved bonus + conflict and clue penalties
    solved: bool
    written: int  # cells whose value changed
    clue_attempts: int  # entries that tried to change a given clue
    violations: int  # rule violations on the board after the answer


def score_fills(
    task: SudokuTask, board: Board, fills: list[tuple[int, int, int]], cfg: SudokuConfig
) -> FillOutcome:
    """Apply `fills` (row, col, value; 0 clears) to a copy of `board`; clue cells never change."""
    n = task.size
    new = [row[:] for row in board]
    clue_attempts = 0
    for r, c, v in fills:
        if task.puzzle[r][c]:
            clue_attempts += v != task.puzzle[r][c]
        else:
            new[r][c] = v
    written = sum(new[r][c] != board[r][c] for r in range(n) for c in range(n))
    before, after = violations(board), violations(new)
    gain = correct_cells(task, new) - correct_cells(task, board)
    shaping = (
        cfg.step_cost + cfg.progress * gain / (n * n) + cfg.violation_shaping * (before - after)
    )
    solved = is_solved(new, task.puzzle)
    outcome = (
        (cfg.solved_bonus if solved else 0.0)
        + (cfg.conflict_penalty if after else 0.0)
        + (cfg.clue_penalty if clue_attempts else 0.0)
    )
    return FillOutcome(new, shaping, outcome, solved, written, clue_attempts, after)


def correct_cells(task: SudokuTask, board: Board) -> int:
    """Non-clue cells holding the solution's digit."""
    n = task.size
    return sum(
        not task.puzzle[r][c] and board[r][c] == task.solution[r][c]
        for r in range(n)
        for c in range(n)
    )


def units(n: int) -> list[list[tuple[int, int]]]:
    """The rows, columns and boxes of an n x n sudoku, as cell lists."""
    b = math.isqrt(n)
    rows = [[(r, c) for c in range(n)] for r in range(n)]
    cols = [[(r, c) for r in range(n)] for c in range(n)]
    boxes = [
        [(br + i, bc + j) for i in range(b) for j in range(b)]
        for br in range(0, n, b)
        for bc in range(0, n, b)
    ]
    return rows + cols + boxes


def violations(board: Board) -> int:
    """Repeated digits summed over all units: each extra copy of a digit in a unit counts 1."""
    total = 0
    for unit in units(len(board)):
        digits = [board[r][c] for r, c in unit if board[r][c]]
        total += len(digits) - len(set(digits))
    return total


def is_solved(board: Board, puzzle: tuple[tuple[int, ...], ...]) -> bool:
    """Complete, no repeated digit in any unit, and every given clue kept."""
    n = len(board)
    if any(v == 0 for row in board for v in row) or violations(board):
        return False
    return all(not puzzle[r][c] or board[r][c] == puzzle[r][c] for r in range(n) for c in range(n))


# --- task ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SudokuTask:
    puzzle: tuple[tuple[int, ...], ...]  # 0 = empty
    solution: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.puzzle)

    @property
    def clues(self) -> int:
        return sum(v != 0 for row in self.puzzle for v in row)

    @cached_property
    def task_id(self) -> str:
        text = "".join(str(v) for row in self.puzzle for v in row)
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "puzzle": [list(r) for r in self.puzzle],
            "solution": [list(r) for r in self.solution],
        }


def generate_task(rng: np.random.Generator, n: int, clues: int) -> SudokuTask:
    """A random full grid, then clues removed in random order while the solution stays unique."""
    solution = solutions([0] * (n * n), n, 1, rng)[0]
    cells, kept = list(solution), n * n
    for i in rng.permutation(n * n):
        if kept <= clues:
            break
        value, cells[i] = cells[i], 0
        if len(solutions(cells, n, 2)) == 1:
            kept -= 1
        else:
            cells[i] = value
    return SudokuTask(_square(cells, n), _square(solution, n))


def _square(cells: list[int], n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(cells[r * n : (r + 1) * n]) for r in range(n))


def task_from_dict(data: dict[str, Any]) -> SudokuTask:
    """A task from `{"puzzle": rows}` (rows of ints, 0/None empty, or strings like "1.3."),
    with an optional `"solution"` that must match; the puzzle must have exactly one solution."""
    if not isinstance(data, dict) or "puzzle" not in data:
        raise ValueError('a sudoku task dict needs a "puzzle" key holding the grid rows')
    puzzle = _rows_from_data(data["puzzle"], "puzzle")
    n = len(puzzle)
    found = solutions([v for row in puzzle for v in row], n, 2)
    if not found:
        raise ValueError("sudoku task: the puzzle has no solution (or breaks a rule)")
    if len(found) > 1:
        raise ValueError("sudoku task: the puzzle has more than one solution; add clues")
    solution = _square(found[0], n)
    if (
        data.get("solution") is not None
        and _rows_from_data(data["solution"], "solution") != solution
    ):
        raise ValueError("sudoku task: the given solution does not solve the puzzle")
    return SudokuTask(puzzle, solution)


def _rows_from_data(rows: Any, what: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(rows, (list, tuple)) or len(rows) not in DEFAULT_CLUES:
        raise ValueError(f"sudoku task {what} must be a list of 4 or 9 rows")
    n, out = len(rows), []
    for row in rows:
        if isinstance(row, str):
            row = [ch for ch in row if ch not in " ,|"]
        if not isinstance(row, (list, tuple)) or len(row) != n:
            raise ValueError(f"sudoku task {what}: every row needs {n} cells, got {row!r}")
        values = [as_cell(v) for v in row]
        for v, value in zip(row, values, strict=True):
            if value is None or not 0 <= value <= n:
                raise ValueError(f"sudoku task {what}: {v!r} is not a digit 0..{n} or empty")
        out.append(tuple(values))
    return tuple(out)


# --- prompts -------------------------------------------------------------------------------


def _rules(n: int) -> str:
    b = math.isqrt(n)
    return (
        f"Fill the {n}x{n} grid with digits 1-{n} so that every row, every column and every "
        f"{b}x{b} box holds each digit exactly once. '.' marks an empty cell; given digits "
        "(clues) cannot change. Rows and columns are numbered from 0."
    )


_ANSWER = (
    "End your answer with `####` followed by the completed grid, one row of digits per line "
    "(e.g. `1 2 3 4`), or a JSON list of rows, or a JSON list of `[row, column, value]` fills. "
    "Your digits stay on the board for the next round."
)

SYSTEM = {
    "tool": (
        "You are the tool agent of a sudoku team. Write a Python program that solves the puzzle "
        "(for example by backtracking) and prints the solved grid as `Solution: [[...], ...]`, "
        "a JSON list of rows. Put the program in one ```python block; it runs with no input and "
        "its output is shown to the plan agent. "
    ),
    "plan": (
        "You are the plan agent of a sudoku team. Decide the digits of the empty cells. The "
        "tool agent's program and its output are shown when available. " + _ANSWER + " "
    ),
}
SOLO_SYSTEM = (
    "You solve sudoku puzzles. You may write a Python program in a ```python block; it runs and "
    "you see its output next round. " + _ANSWER + " "
)


# show_candidates or show_empty, single agent: the answer alone (no program), in one format.
HINTED_SOLO_SYSTEM = (
    "You solve sudoku puzzles: fill each empty cell with the digit that fits. End your answer "
    "with #### and one [row, column, value] fill per empty cell: #### [[row, column, value], ...]. "
)


@dataclass
class SudokuState(EpisodeState):
    board: Board = field(default_factory=list)
    tool_runs: list[ToolRun] = field(default_factory=list)


class SudokuEnv(MASEnv):
    name = "sudoku"
    roles = ("tool", "plan")
    solo_role = "plan"
    config_class = SudokuConfig
    answer_tokens = 64  # moves or a short program (examples/learning: 24-48)
    grid_render = True

    config: SudokuConfig
    task: SudokuTask
    state: SudokuState

    def generate_task(self, rng: np.random.Generator) -> SudokuTask:
        return generate_task(rng, self.config.size, self.config.target_clues)

    def load_task(self, task: Any) -> SudokuTask:
        if isinstance(task, SudokuTask):
            return task
        if isinstance(task, dict):
            return task_from_dict(task)
        raise ValueError(f"a sudoku task must be a SudokuTask or a dict, got {type(task).__name__}")

    def initial_state(self, task: SudokuTask) -> SudokuState:
        return SudokuState(board=[list(row) for row in task.puzzle])

    def task_info(self) -> dict[str, Any]:
        n = self.task.size
        return {
            "task_id": self.task.task_id,
            "size": n,
            "clues": self.task.clues,
            "empty_cells": n * n - self.task.clues,
        }

    def board_rows(self) -> list[str]:
        return ["".join(str(v) if v else "." for v in row) for row in self.state.board]

    def prompt(self, agent: str) -> list[Message]:
        n = self.task.size
        cfg = self.config
        fills = cfg.show_candidates or cfg.show_empty  # the answer as fills, asked for last
        solo = HINTED_SOLO_SYSTEM if fills else SOLO_SYSTEM
        system = (solo if self.config.single_agent else SYSTEM[agent]) + _rules(n)
        empty = sum(v == 0 for row in self.state.board for v in row)
        lines = [
            f"Board ({n}x{n}, {empty} empty cells):",
            grid.grid_text(self.board_rows()),
            f"As a JSON list of rows (0 = empty): {json.dumps(self.state.board)}",
            *(
                candidate_lines(self.state.board)
                if cfg.show_candidates
                else empty_line(self.state.board)
                if cfg.show_empty
                else []
            ),
            f"Round {self.round + 1} of {self.config.max_rounds}.",
        ]
        lines += round_context(
            agent,
            self.last_feedback.get(agent),
            self.state.tool_runs,
            show_tool=not self.config.single_agent,
        )
        if fills and agent == "plan":  # the format, last
            lines += [
                "",
                "Answer with #### and the fill of every empty cell, in the form "
                "#### [[row, column, value], ...]",
            ]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one round ----------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "tool":
            return self._tool_turn(action)
        return self._plan_turn(action)

    def _tool_turn(self, action: str) -> RewardParts:
        """The tool's printed grid is scored on a copy: the tool never writes the board."""
        cfg, task = self.config, self.task
        run = run_tool(action, cfg.tool_timeout)
        self.state.tool_runs.append(run)
        answer = parse_answer(run.output, task.size, marker="Solution:") if run.ok else None
        if answer is None:
            self.last_feedback["tool"] = run.describe() + "\nNo grid found in the output."
            return RewardParts(agent=cfg.format_penalty)
        sim = score_fills(task, self.state.board, answer.fills, cfg)
        self.last_feedback["tool"] = run.describe() + "\n" + _describe(sim, answer)
        return RewardParts(process=sim.shaping, agent=sim.outcome)

    def _plan_turn(self, plan_text: str) -> RewardParts:
        """The plan's cells are the team's: the solved bonus is the team reward, counted once;
        the plan's own part keeps the penalties of its answer (conflicts, clue changes)."""
        cfg, task, state = self.config, self.task, self.state
        run = None
        if cfg.single_agent and "```" in plan_text:
            run = run_tool(plan_text, cfg.tool_timeout)
            state.tool_runs.append(run)
        answer = parse_answer(plan_text, task.size)
        if answer is None:
            feedback = "No grid or fills found: end with `####` and the grid."
            parts = RewardParts(agent=cfg.format_penalty)
        else:
            out = score_fills(task, state.board, answer.fills, cfg)
            state.board, state.success = out.board, out.solved
            team = cfg.solved_bonus if out.solved else 0.0
            feedback = _describe(out, answer)
            parts = RewardParts(process=out.shaping, agent=out.outcome - team, team=team)
        self.last_feedback["plan"] = feedback + (f"\n{run.describe()}" if run is not None else "")
        return parts

    # --- pictures -----------------------------------------------------------------------------

    def render_text(self) -> str:
        status = "solved" if self.state.success else f"round {self.round}"
        return f"sudoku ({status})\n{grid.grid_text(self.board_rows())}"

    def render_rgb(self) -> np.ndarray:
        n, cell = self.task.size, 24
        clash = _clashing_cells(self.state.board)
        colors: dict[grid.Cell, tuple[int, int, int]] = {}
        for r in range(n):
            for c in range(n):
                if self.task.puzzle[r][c]:
                    colors[r, c] = (225, 225, 225)  # clue: grey
                elif (r, c) in clash:
                    colors[r, c] = (255, 200, 200)  # breaks a rule: red
                elif self.state.board[r][c]:
                    colors[r, c] = (215, 232, 255)  # filled by the agents: blue
        image = grid.render_cells(self.board_rows(), {}, cell=cell, cell_colors=colors)
        b = math.isqrt(n)
        for k in range(0, n + 1, b):  # thick box borders
            edge = min(k * cell, n * cell - 2)
            image[edge : edge + 2, :, :] = 40
            image[:, edge : edge + 2, :] = 40
        return image


def _clashing_cells(board: Board) -> set[tuple[int, int]]:
    clash: set[tuple[int, int]] = set()
    for unit in units(len(board)):
        seen: dict[int, list[tuple[int, int]]] = {}
        for r, c in unit:
            if board[r][c]:
                seen.setdefault(board[r][c], []).append((r, c))
        for cells in seen.values():
            if len(cells) > 1:
                clash.update(cells)
    return clash


def _describe(out: FillOutcome, answer: SudokuAnswer) -> str:
    empty = sum(v == 0 for row in out.board for v in row)
    if out.solved:
        return "The grid is solved."
    notes = [f"{out.written} cell(s) changed; {empty} empty cell(s) left."]
    if out.violations:
        notes.append(f"The board breaks the rules {out.violations} time(s) (a repeated digit).")
    if out.clue_attempts:
        notes.append(f"{out.clue_attempts} entry(ies) tried to change a given clue (ignored).")
    if answer.dropped:
        notes.append(f"{answer.dropped} entry(ies) were out of range (ignored).")
    return " ".join(notes)
