"""Sokoban: push every box onto a goal in a walled room.

Roles (Stronger-MAS), in turn order: `tool` writes Python that searches for the moves (run in
the sandbox); `plan` then sees the tool's program and its output of the same round and gives
the moves the team commits. Single-agent mode: `plan` alone, which may also write code.
Levels come from reverse play, so each is solvable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.envs import grid
from masenvs.envs.grid import Cell
from masenvs.envs.sokoban_level import SokobanTask
from masenvs.envs.sokoban_solver import SearchResult as SearchResult  # (defined here before)
from masenvs.envs.sokoban_solver import reverse_play, solve
from masenvs.envs.tooling import ToolRun, round_context, run_tool
from masenvs.parsing import parse_moves


class SokobanConfig(EnvConfig):
    width: int = Field(6, ge=5, le=16, description="Room width in cells, outer walls included.")
    height: int = Field(6, ge=5, le=16, description="Room height in cells, outer walls included.")
    boxes: int = Field(1, ge=1, le=4, description="Boxes (and goals) in the room.")
    min_pushes: int = Field(
        2,
        ge=1,
        description="Levels need at least this many pushes (box-to-nearest-goal distances).",
    )
    max_solution_moves: int | None = Field(
        None,
        ge=1,
        description="Cap on the shortest solution's length (None: the farthest "
        "start the reverse play finds, the hardest level of the room).",
    )
    step_cost: float = Field(-0.01, description="Added for every move, valid or not.")
    invalid_move: float = Field(-0.05, description="Walking into a wall, pushing into wall or box.")
    box_on_goal: float = Field(1.0, description="For pushing a box onto a goal.")
    box_off_goal: float = Field(
        -1.0, description="For pushing a box off a goal; -box_on_goal so on/off loops earn nothing."
    )
    shaping: float = Field(
        0.1,
        description="lambda of the potential shaping on -(sum of box-to-nearest-goal distance).",
    )
    gamma: float = Field(1.0, description="Discount in the potential shaping.")
    win_bonus: float = Field(2.0, description="For having every box on a goal.")
    deadlock_penalty: float = Field(
        -1.0, description="For pushing a box where it can never reach a goal; the episode fails."
    )
    format_penalty: float = Field(-1.0, description="For an answer with no parsable moves.")
    tool_timeout: float = Field(5.0, gt=0, description="Wall seconds for the tool's program.")
    show_offset: bool = Field(
        False,
        description="Also state, for each box off a goal, where its nearest goal lies from it "
        "and the cell to push it from, with the straight moves, e.g. 'The box at row 2, column "
        "2: its goal is 1 column right of it. To push it right, stand at row 2, column 1 (from "
        "you: D) and push R: [D, R] if no wall is in the way.': the arithmetic a small model gets "
        "wrong, done for it (as plan_path's show_offset); walls still need detours. Single-agent "
        "mode then asks for the moves alone, no program.",
    )
    solver_states: int = Field(
        100_000, ge=100, description="State budget of the searches that generate and check levels."
    )


# --- reward --------------------------------------------------------------------------------


@dataclass
class PushOutcome:
    """What a list of moves does from a position (applied, or simulated for the tool)."""

    player: Cell
    boxes: frozenset[Cell]
    valid_moves: int
    pushes: int
    shaping: float  # step costs + invalid moves + box on/off goal + potential shaping
    solved: bool
    deadlocked: bool  # a box stands on a dead square: the level cannot be won any more
    invalid: int


def score_moves(
    task: SokobanTask, player: Cell, boxes: frozenset[Cell], moves: list[str], cfg: SokobanConfig
) -> PushOutcome:
    """Walk `moves`; stop when solved or deadlocked. Invalid moves change nothing."""
    valid = pushes = invalid = 0
    shaping = 0.0
    for move in moves:
        if task.solved(boxes) or task.deadlocked(boxes):
            break
        shaping += cfg.step_cost
        nxt = grid.step_cell(player, move)
        if not task.is_floor(nxt):
            shaping, invalid = shaping + cfg.invalid_move, invalid + 1
            continue
        before = task.potential(boxes)
        if nxt in boxes:
            beyond = grid.step_cell(nxt, move)
            if not task.is_floor(beyond) or beyond in boxes:
                shaping, invalid = shaping + cfg.invalid_move, invalid + 1
                continue
            boxes = (boxes - {nxt}) | {beyond}
            pushes += 1
            if beyond in task.goals and nxt not in task.goals:
                shaping += cfg.box_on_goal
            if nxt in task.goals and beyond not in task.goals:
                shaping += cfg.box_off_goal
        player, valid = nxt, valid + 1
        shaping += cfg.shaping * (cfg.gamma * task.potential(boxes) - before)
    return PushOutcome(
        player, boxes, valid, pushes, shaping, task.solved(boxes), task.deadlocked(boxes), invalid
    )


def outcome_reward(solved: bool, deadlocked: bool, cfg: SokobanConfig) -> float:
    return (cfg.win_bonus if solved else 0.0) + (cfg.deadlock_penalty if deadlocked else 0.0)


# --- task ----------------------------------------------------------------------------------


def generate_task(rng: np.random.Generator, cfg: SokobanConfig, attempts: int = 500) -> SokobanTask:
    """Carve a room, put the boxes on goals, then play in reverse (moves and pulls, never
    pushes) and start from a state the reverse play reaches last: solvable by construction."""
    for _ in range(attempts):
        floor = _carve_room(rng, cfg.width, cfg.height)
        cells = sorted(floor)
        if len(cells) < cfg.boxes + 2:
            continue
        goals = frozenset(cells[i] for i in rng.choice(len(cells), size=cfg.boxes, replace=False))
        layout = tuple(
            "".join(
                "." if (r, c) in goals else "_" if (r, c) in floor else "#"
                for c in range(cfg.width)
            )
            for r in range(cfg.height)
        )
        room = SokobanTask(layout, tuple(sorted(goals)), cells[0])  # solved; player unused
        depth = reverse_play(room, cfg.solver_states)
        # The farthest states (capped by max_solution_moves) whose boxes need min_pushes pushes.
        layers: dict[int, list[tuple[Cell, frozenset[Cell]]]] = {}
        cap = cfg.max_solution_moves
        for (player, boxes), d in depth.items():
            if (cap is None or d <= cap) and -room.potential(boxes) >= cfg.min_pushes:
                layers.setdefault(d, []).append((player, boxes))
        if not layers:
            continue
        d = max(layers)
        candidates = sorted(layers[d], key=lambda s: (s[0], sorted(s[1])))
        player, boxes = candidates[int(rng.integers(len(candidates)))]
        return SokobanTask(layout, tuple(sorted(boxes)), player, optimal_moves=d)
    raise RuntimeError(
        f"no {cfg.width}x{cfg.height} level with {cfg.boxes} box(es) and min_pushes="
        f"{cfg.min_pushes} after {attempts} tries: use a bigger room, fewer boxes or fewer pushes"
    )


_TURN = 0.35  # chance that the carving walk changes direction at a step


def _carve_room(rng: np.random.Generator, width: int, height: int) -> set[Cell]:
    """Floor cells made by a random walk inside the outer walls (connected by construction)."""
    inner = (height - 2) * (width - 2)
    cell = (int(rng.integers(1, height - 1)), int(rng.integers(1, width - 1)))
    moves = list(grid.DELTAS)
    direction = moves[int(rng.integers(4))]
    floor = {cell}
    for _ in range(2 * inner):
        r, c = grid.step_cell(cell, direction)
        if rng.random() < _TURN or not (1 <= r < height - 1 and 1 <= c < width - 1):
            direction = moves[int(rng.integers(4))]
            r, c = grid.step_cell(cell, direction)
        if 1 <= r < height - 1 and 1 <= c < width - 1:
            cell = (r, c)
            floor.add(cell)
    return floor


_FLOOR_CHARS = {
    "#": "#",
    "_": "_",
    " ": "_",
    "-": "_",
    ".": ".",
    "$": "_",
    "*": ".",
    "@": "_",
    "+": ".",
}


def task_from_dict(data: dict[str, Any], max_states: int = 100_000) -> SokobanTask:
    """A task from `{"level": rows}` in XSB notation ('#', '_'/' '/'-' floor, '.', '$', '*',
    '@', '+'); short rows are padded with walls. Unsolvable levels are refused."""
    if not isinstance(data, dict) or "level" not in data:
        raise ValueError('a sokoban task dict needs a "level" key holding the rows')
    rows = data["level"]
    if isinstance(rows, str):
        rows = rows.splitlines()
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, str) for r in rows):
        raise ValueError("sokoban task level must be a non-empty list of strings")
    width = max(len(r) for r in rows)
    layout, boxes, players = [], [], []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch not in _FLOOR_CHARS:
                raise ValueError(f"sokoban task: unknown symbol {ch!r} at row {r}, column {c}")
            if ch in "$*":
                boxes.append((r, c))
            if ch in "@+":
                players.append((r, c))
        layout.append("".join(_FLOOR_CHARS[ch] for ch in row).ljust(width, "#"))
    goals = sum(row.count(".") for row in layout)
    if len(players) != 1:
        raise ValueError(f"sokoban task: the level needs exactly one player, found {len(players)}")
    if not boxes or len(boxes) != goals:
        raise ValueError(
            f"sokoban task: {len(boxes)} box(es) but {goals} goal(s); need equal, >= 1"
        )
    task = SokobanTask(tuple(layout), tuple(sorted(boxes)), players[0])
    if task.solved(frozenset(task.boxes)):
        raise ValueError("sokoban task: every box is already on a goal")
    if task.deadlocked(frozenset(task.boxes)):
        raise ValueError("sokoban task: a box stands where it can never reach a goal")
    found = solve(task, max_states)
    if found.moves is None and found.exhausted:
        raise ValueError("sokoban task: the level cannot be solved")
    optimal = len(found.moves) if found.moves is not None else None
    return SokobanTask(task.layout, task.boxes, task.player, optimal)


# --- prompts -------------------------------------------------------------------------------

_RULES = (
    "Symbols: '#' wall, '_' floor, '.' goal, '$' box, '*' box on a goal, '@' you, '+' you on a "
    "goal. Rows are numbered from the top, columns from the left. Moves: U (row-1), D (row+1), "
    "L (column-1), R (column+1). Walking into a box pushes it one cell if the cell behind it is "
    "free; you cannot pull boxes. A move into a wall, or a push into a wall or another box, is "
    "invalid and wastes a step. You win when every box is on a goal; a box pushed where it can "
    "never reach a goal (e.g. a corner without a goal) loses the level."
)

SYSTEM = {
    "tool": (
        "You are the tool agent of a Sokoban team. Write a Python program that finds the moves "
        "that put every box on a goal (for example breadth-first search over the player and box "
        "positions) and prints them as `Moves: [..]`. Put the program in one ```python block; it "
        "runs with no input and its output is shown to the plan agent. " + _RULES
    ),
    "plan": (
        "You are the plan agent of a Sokoban team. Decide the moves that put every box on a "
        "goal. The tool agent's program and its output are shown when available. End your "
        "answer with `#### [moves]`, e.g. `#### [R, R, D]`. " + _RULES
    ),
}
SOLO_SYSTEM = (
    "You solve Sokoban levels. You may write a Python program in a ```python block; it runs and "
    "you see its output next round. End your answer with `#### [moves]`, e.g. `#### [R, R, D]`; "
    "those moves are executed. " + _RULES
)


_WORD = {"U": "up", "D": "down", "L": "left", "R": "right"}


def offset_lines(task: SokobanTask, player: Cell, boxes: frozenset[Cell]) -> list[str]:
    """For each box off a goal: its nearest free goal and the player, relative to the box, e.g.
    'The box at row 2, column 2: its goal is 2 columns right of it. To push it right, stand at
    row 2, column 1 (from you: D, L) and push R, R: [D, L, R, R] if no wall is in the way.'
    Straight moves; walls are not taken into account."""
    free = sorted(task.goals - boxes)
    lines = []
    for box in sorted(boxes - task.goals):
        goal = min(free, key=lambda g: grid.manhattan(g, box))
        to_goal, pushes = grid.straight_moves(box, goal)
        first = grid.step_cell(box, pushes[0])  # the first push's direction
        behind = (2 * box[0] - first[0], 2 * box[1] - first[1])
        walk = grid.straight_moves(player, behind)[1]
        moves = ", ".join(m for m in (walk, pushes) if m)
        lines.append(
            f"The box at row {box[0]}, column {box[1]}: its goal is {to_goal} of it. To push it "
            f"{_WORD[pushes[0]]}, stand at row {behind[0]}, column {behind[1]}"
            + (f" (from you: {walk})" if walk else " (you are there)")
            + f" and push {pushes}: [{moves}] if no wall is in the way."
        )
    return lines


# show_offset, single agent: the moves alone (no program).
HINTED_SOLO_SYSTEM = (
    "You solve Sokoban levels: push the box onto the goal. Symbols: '#' wall, '_' floor, '.' "
    "goal, '$' box, '*' box on a goal, '@' you. Moves: U (row-1), D (row+1), L (column-1), R "
    "(column+1); walking into a box pushes it. End your answer with #### and the list of "
    "moves in brackets."
)


@dataclass
class SokobanState(EpisodeState):
    player: Cell = (0, 0)
    boxes: frozenset[Cell] = frozenset()
    moves: int = 0  # valid moves taken so far
    pushes: int = 0
    tool_runs: list[ToolRun] = field(default_factory=list)


class SokobanEnv(MASEnv):
    name = "sokoban"
    roles = ("tool", "plan")
    solo_role = "plan"
    config_class = SokobanConfig
    answer_tokens = 64  # moves or a short program (examples/learning: 24-48)
    grid_render = True

    config: SokobanConfig
    task: SokobanTask
    state: SokobanState

    def generate_task(self, rng: np.random.Generator) -> SokobanTask:
        return generate_task(rng, self.config)

    def load_task(self, task: Any) -> SokobanTask:
        if isinstance(task, SokobanTask):
            return task
        if isinstance(task, dict):
            return task_from_dict(task, self.config.solver_states)
        raise ValueError(
            f"a sokoban task must be a SokobanTask or a dict, got {type(task).__name__}"
        )

    def initial_state(self, task: SokobanTask) -> SokobanState:
        return SokobanState(player=task.player, boxes=frozenset(task.boxes))

    def task_info(self) -> dict[str, Any]:
        return {
            "task_id": self.task.task_id,
            "width": self.task.width,
            "height": self.task.height,
            "boxes": len(self.task.boxes),
            "optimal_moves": self.task.optimal_moves,
        }

    def board(self) -> list[str]:
        return self.task.rows(self.state.player, self.state.boxes)

    def prompt(self, agent: str) -> list[Message]:
        solo = HINTED_SOLO_SYSTEM if self.config.show_offset else SOLO_SYSTEM
        system = solo if self.config.single_agent else SYSTEM[agent]
        on_goal = len(self.state.boxes & self.task.goals)
        pos = self.state.player
        lines = [
            f"Level ({self.task.height} rows x {self.task.width} columns):",
            grid.grid_text(self.board()),
            f"You are at row {pos[0]}, column {pos[1]}. Boxes on goals: {on_goal} of "
            f"{len(self.task.goals)}.",
            *(offset_lines(self.task, pos, self.state.boxes) if self.config.show_offset else []),
            f"Round {self.round + 1} of {self.config.max_rounds}.",
        ]
        lines += round_context(
            agent,
            self.last_feedback.get(agent),
            self.state.tool_runs,
            show_tool=not self.config.single_agent,
        )
        if self.config.show_offset and agent == "plan":  # the format, last, as plan_path does
            lines += ["", "Answer with #### and the list of moves in brackets, as written above."]
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
        """The tool's printed moves are scored on a copy: the tool never moves the team."""
        cfg, task, state = self.config, self.task, self.state
        run = run_tool(action, cfg.tool_timeout)
        state.tool_runs.append(run)
        moves = parse_moves(run.output, marker="Moves:") if run.ok else None
        if moves is None:
            self.last_feedback["tool"] = run.describe() + "\nNo moves found in the output."
            return RewardParts(agent=cfg.format_penalty)
        sim = score_moves(task, state.player, state.boxes, moves, cfg)
        self.last_feedback["tool"] = run.describe() + "\n" + _describe(moves, sim)
        return RewardParts(
            process=sim.shaping, agent=outcome_reward(sim.solved, sim.deadlocked, cfg)
        )

    def _plan_turn(self, plan_text: str) -> RewardParts:
        """The plan's moves are the team's: their outcome is the team reward, counted once."""
        cfg, task, state = self.config, self.task, self.state
        run = None
        if cfg.single_agent and "```" in plan_text:
            run = run_tool(plan_text, cfg.tool_timeout)
            state.tool_runs.append(run)
        moves = parse_moves(plan_text)
        if moves is None:
            feedback = "No moves found: end with `#### [moves]`."
            parts = RewardParts(agent=cfg.format_penalty)
        else:
            out = score_moves(task, state.player, state.boxes, moves, cfg)
            state.player, state.boxes = out.player, out.boxes
            state.moves, state.pushes = state.moves + out.valid_moves, state.pushes + out.pushes
            state.success, state.failed = out.solved, out.deadlocked
            feedback = _describe(moves, out)
            parts = RewardParts(
                process=out.shaping, team=outcome_reward(out.solved, out.deadlocked, cfg)
            )
        self.last_feedback["plan"] = feedback + (f"\n{run.describe()}" if run is not None else "")
        return parts

    # --- pictures -----------------------------------------------------------------------------

    def render_text(self) -> str:
        status = (
            "solved"
            if self.state.success
            else "deadlocked"
            if self.state.failed
            else (f"round {self.round}")
        )
        head = f"sokoban ({status}, {self.state.moves} moves, {self.state.pushes} pushes)"
        return f"{head}\n{grid.grid_text(self.board())}"

    def render_rgb(self) -> np.ndarray:
        palette = {
            "#": (60, 60, 70),
            "_": (235, 235, 235),
            ".": (150, 220, 150),
            "$": (190, 130, 60),
            "*": (60, 170, 80),
            "@": (40, 120, 230),
            "+": (40, 170, 230),
        }
        return grid.render_cells(self.board(), palette)


def _describe(moves: list[str], out: PushOutcome) -> str:
    where = f"Moves {''.join(moves)}: {out.valid_moves} taken, {out.invalid} invalid, " + (
        f"{out.pushes} push(es); you are at {out.player}."
    )
    if out.solved:
        return where + " Every box is on a goal."
    if out.deadlocked:
        return where + " A box can no longer reach a goal: the level is lost."
    return where
