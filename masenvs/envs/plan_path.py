"""Plan-path: lead an agent through a grid with obstacles to the goal.

Roles (Stronger-MAS), in turn order: `tool` writes Python that computes the moves (run in the
sandbox); `plan` then sees the tool's program and its output of the same round and gives the
moves the team commits. Single-agent mode: `plan` alone, which may also write code.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.envs import grid
from masenvs.envs.tooling import ToolRun, round_context, run_tool
from masenvs.parsing import parse_moves


class PlanPathConfig(EnvConfig):
    size: int = Field(6, ge=3, le=40, description="The grid is size x size.")
    obstacle_ratio: float = Field(0.22, ge=0.0, le=0.6, description="Share of cells blocked.")
    max_rounds: int = Field(4, ge=1, le=1000, description="Rounds before the episode truncates.")
    step_cost: float = Field(-0.01, description="Added for every move, valid or not.")
    invalid_move: float = Field(-0.1, description="Added for a move into a wall or off the grid.")
    shaping: float = Field(1.0, description="lambda of the potential shaping on -distance/size.")
    gamma: float = Field(0.99, description="Discount in the potential shaping.")
    goal_bonus: float = Field(1.0, description="For reaching the goal.")
    optimal_bonus: float = Field(0.5, description="Extra when the whole path is BFS-optimal.")
    format_penalty: float = Field(-1.0, description="For an answer with no parsable moves.")
    tool_timeout: float = Field(5.0, gt=0, description="Wall seconds for the tool's program.")
    tool_task: Literal["search", "propose"] = Field(
        "search",
        description="What the tool agent does: 'search', write a program that computes the path "
        "(the paper's role; its output is scored); 'propose', answer with moves like the plan "
        "agent, scored on a copy of the board and shown to the plan as a proposal: a role a "
        "135M model can play (no program runs).",
    )
    show_offset: bool = Field(
        False,
        description="Also state where G lies from A and the straight moves there (rows "
        "first), e.g. 'G is 2 rows down and 1 column left of A: D, D, L if no wall is in the "
        "way.': the arithmetic a small model gets wrong, done for it; walls still need detours.",
    )
    stop_at_goal: bool = Field(
        True,
        description="Moves after the goal is reached are ignored. False: every move is walked, "
        "so an answer succeeds only if it ENDS on G; a fixed sweep of the grid that passes "
        "through G earns nothing (on 4x4 the best fixed 8-move answer reaches G on 50% of tasks "
        "with True, ends on it on 19% with False: docs/learning.md).",
    )
    strict_success: bool = Field(
        False,
        description="Success only for a plan that stops on G: an answer with moves after the "
        "goal fails the episode (no goal or optimal bonus). False: moves after G do not undo "
        "the success (with stop_at_goal they are ignored); the `exact_stop` rate counts the "
        "plans that stopped on G either way.",
    )
    answer_example: bool = Field(
        True,
        description="The prompts show an example answer (`#### [R, D, D]`). SmolLM2-135M's "
        "greedy answer copies it on every task (docs/learning.md). False: the answer format "
        "is described in words, with no moves to copy.",
    )
    max_distance: int | None = Field(
        None,
        ge=1,
        description="Draw only tasks whose goal is at most this many moves (BFS) from A: a "
        "curriculum of near goals for training, while `validation.env_options` can validate on "
        "every distance (docs/learning.md). None: any reachable goal.",
    )
    offset_moves: bool = Field(
        True,
        description="With show_offset, also list the straight moves (': D, D, L if no wall is in "
        "the way.'). False: only where G lies ('G is 2 rows down and 1 column left of A.'); "
        "the agents turn the words into moves themselves.",
    )

    @model_validator(mode="after")
    def _warn_free_padding(self) -> PlanPathConfig:
        """Name the reward hole RL found (docs/learning.md, issue 46): every move walked, moves
        into a wall free and success not strict, so G on the edge plus moves into it succeeds."""
        free = self.invalid_move >= 0 and self.step_cost >= 0
        if not self.stop_at_goal and not self.strict_success and free:
            warnings.warn(
                "plan_path: with stop_at_goal=false, invalid_move and step_cost >= 0 and "
                "strict_success=false, an answer that reaches G and then walks into a wall still "
                "ends on G and succeeds: RL learns to pad answers (docs/learning.md, cold start); "
                "set strict_success=true, or a negative invalid_move",
                UserWarning,
                stacklevel=2,
            )
        return self


# --- reward --------------------------------------------------------------------------------


@dataclass
class MoveOutcome:
    """What a list of moves does from a position (applied, or simulated for the tool)."""

    end: grid.Cell
    valid_moves: int
    shaping: float  # step costs + invalid-move penalties + potential shaping
    reached: bool
    after_goal: int = 0  # moves listed after the one that first reached G (walked or not)


def score_moves(
    task: PlanPathTask, start: grid.Cell, moves: list[str], cfg: PlanPathConfig
) -> MoveOutcome:
    """Walk `moves` from `start`; stop at the goal (unless `cfg.stop_at_goal` is off). Invalid
    moves leave the position unchanged."""
    pos, valid, shaping, reached_at = start, 0, 0.0, None
    for i, move in enumerate(moves):
        if pos == task.goal:
            reached_at = i if reached_at is None else reached_at
            if cfg.stop_at_goal:
                break
        nxt = grid.step_cell(pos, move)
        before = -grid.manhattan(pos, task.goal) / task.size
        shaping += cfg.step_cost
        if task.is_free(nxt):
            pos, valid = nxt, valid + 1
        else:
            shaping += cfg.invalid_move
        after = -grid.manhattan(pos, task.goal) / task.size
        shaping += cfg.shaping * (cfg.gamma * after - before)
    reached = pos == task.goal
    after_goal = len(moves) - (len(moves) if reached_at is None else reached_at)
    return MoveOutcome(pos, valid, shaping, reached, after_goal if reached else 0)


def outcome_reward(outcome: MoveOutcome, steps_so_far: int, task: PlanPathTask, cfg) -> float:
    """Goal bonus, plus the optimal bonus when the total path length equals BFS's; nothing for
    a plan that goes past G under `strict_success`."""
    if not outcome.reached or (cfg.strict_success and outcome.after_goal):
        return 0.0
    optimal = steps_so_far + outcome.valid_moves == task.optimal_length
    return cfg.goal_bonus + (cfg.optimal_bonus if optimal else 0.0)


def past_goal(moves_after: int) -> str:
    """What `strict_success` says of an answer: stopped on G, or how far past it."""
    if moves_after == 0:
        return "It stops on G."
    return f"{moves_after} move(s) went on past the goal: the plan must stop on G."


# --- task ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanPathTask:
    rows: tuple[str, ...]  # '.' free, '#' wall
    start: grid.Cell
    goal: grid.Cell
    optimal_length: int

    @property
    def size(self) -> int:
        return len(self.rows)

    def is_free(self, cell: grid.Cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and self.rows[r][c] == "."

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": list(self.rows),
            "start": list(self.start),
            "goal": list(self.goal),
            "optimal_length": self.optimal_length,
        }


def generate_task(
    rng: np.random.Generator, size: int, obstacle_ratio: float, max_distance: int | None = None
) -> PlanPathTask:
    """A random grid whose goal is reachable from the start (BFS-checked), at most
    `max_distance` moves away when given."""
    while True:
        walls = rng.random((size, size)) < obstacle_ratio
        free_cells = np.argwhere(~walls)
        if len(free_cells) < 2:
            continue
        i, j = rng.choice(len(free_cells), size=2, replace=False)
        start, goal = tuple(map(int, free_cells[i])), tuple(map(int, free_cells[j]))
        dist = grid.bfs_distances(~walls, start)
        if dist[goal] > 0 and (max_distance is None or dist[goal] <= max_distance):
            rows = tuple("".join("#" if w else "." for w in row) for row in walls)
            return PlanPathTask(rows, start, goal, int(dist[goal]))


def task_from_dict(data: dict[str, Any]) -> PlanPathTask:
    rows = tuple(data["rows"])
    if not rows or any(len(r) != len(rows) for r in rows):
        raise ValueError("plan_path task rows must form a square grid")
    start, goal = tuple(data["start"]), tuple(data["goal"])
    free = np.array([[ch == "." for ch in r] for r in rows])
    dist = grid.bfs_distances(free, start)
    if dist[goal] <= 0:
        raise ValueError("plan_path task: the goal is not reachable from the start")
    return PlanPathTask(rows, start, goal, int(dist[goal]))


# --- prompts -------------------------------------------------------------------------------

_RULES = (
    "The grid uses '.' for free cells, '#' for walls, 'A' for your position and 'G' for the "
    "goal. Rows are numbered from the top, columns from the left. Moves: U (row-1), D (row+1), "
    "L (column-1), R (column+1). A move into a wall or off the grid is invalid and wastes a step."
)

SYSTEM = {
    "tool": (
        "You are the tool agent of a path-planning team. Write a Python program that computes a "
        "shortest path from A to G (for example with breadth-first search) and prints it as "
        "`Moves: [..]`. Put the program in one ```python block; it runs with no input and its "
        "output is shown to the plan agent. " + _RULES
    ),
    "plan": (
        "You are the plan agent of a path-planning team. Decide the moves that take the agent "
        "from A to G in as few steps as possible. The tool agent's program and its output are "
        "shown when available. End your answer with `#### [moves]`, e.g. `#### [R, R, D]`. "
        + _RULES
    ),
}
# The last line of every prompt repeats the answer format: small models follow what they read last.
ASK = {
    "tool": "Answer with a ```python block that prints `Moves: [...]`.",
    "plan": "Answer with your moves after ####, for example: #### [R, D, D]",
}
PROPOSE_SYSTEM = (
    "You are the tool agent of a path-planning team. Propose the moves that take the agent "
    "from A to G in as few steps as possible; the plan agent sees your proposal and decides. "
    "End your answer with `#### [moves]`, e.g. `#### [R, R, D]`. " + _RULES
)
SOLO_SYSTEM = (
    "You solve path-planning tasks. You may write a Python program in a ```python block; it "
    "runs and you see its output next round. End your answer with `#### [moves]`, e.g. "
    "`#### [R, R, D]`; those moves are executed. " + _RULES
)


# Without `answer_example`: the same format, described without moves a model could copy.
_EXAMPLES = {
    ", e.g. `#### [R, R, D]`": ", the moves in brackets, each one of U, D, L or R",
    "for example: #### [R, D, D]": "as a bracketed list of U, D, L and R",
}


def without_example(text: str) -> str:
    """`text` with its example answer replaced by words."""
    for example, words in _EXAMPLES.items():
        text = text.replace(example, words)
    return text


def offset_text(pos: grid.Cell, goal: grid.Cell, moves: bool = True) -> str:
    """Where G lies from A and the straight moves there, e.g.
    'G is 2 rows down and 1 column left of A: D, D, L if no wall is in the way.'
    (without `moves`: 'G is 2 rows down and 1 column left of A.')"""
    where, straight = grid.straight_moves(pos, goal)
    if not where:
        return "G is at A."
    return (
        f"G is {where} of A: {straight} if no wall is in the way."
        if moves
        else f"G is {where} of A."
    )


@dataclass
class PlanPathState(EpisodeState):
    pos: grid.Cell = (0, 0)
    steps: int = 0  # valid moves taken so far
    tool_runs: list[ToolRun] = field(default_factory=list)
    proposal: list[str] | None = None  # the tool's moves this round (tool_task "propose")
    reached: bool = False  # the team's moves reached G (a success unless strict_success)
    after_goal: int = 0  # moves the team gave after reaching G


class PlanPathEnv(MASEnv):
    name = "plan_path"
    roles = ("tool", "plan")
    solo_role = "plan"
    config_class = PlanPathConfig
    answer_tokens = 64  # moves or a short program (examples/learning: 24-48)
    grid_render = True

    config: PlanPathConfig
    task: PlanPathTask
    state: PlanPathState

    def generate_task(self, rng: np.random.Generator) -> PlanPathTask:
        cfg = self.config
        return generate_task(rng, cfg.size, cfg.obstacle_ratio, cfg.max_distance)

    def load_task(self, task: Any) -> PlanPathTask:
        return task if isinstance(task, PlanPathTask) else task_from_dict(task)

    def initial_state(self, task: PlanPathTask) -> PlanPathState:
        return PlanPathState(pos=task.start)

    def task_info(self) -> dict[str, Any]:
        return {"optimal_length": self.task.optimal_length, "size": self.task.size}

    def episode_metrics(self) -> dict[str, float]:
        """`exact_stop`: the team reached G and gave no move after it; `optimal`: that, along
        a BFS-shortest path (invalid moves do not move A, so they are not part of it)."""
        exact = self.state.reached and self.state.after_goal == 0
        optimal = exact and self.state.steps == self.task.optimal_length
        return {"optimal": float(optimal), "exact_stop": float(exact)}

    def board(self) -> list[str]:
        rows = [list(r) for r in self.task.rows]
        rows[self.task.goal[0]][self.task.goal[1]] = "G"
        rows[self.state.pos[0]][self.state.pos[1]] = "A"
        return ["".join(r) for r in rows]

    def prompt(self, agent: str) -> list[Message]:
        cfg = self.config
        propose = agent == "tool" and cfg.tool_task == "propose"
        system = SOLO_SYSTEM if cfg.single_agent else PROPOSE_SYSTEM if propose else SYSTEM[agent]
        pos, goal = self.state.pos, self.task.goal
        lines = [
            f"Grid ({self.task.size}x{self.task.size}):",
            grid.grid_text(self.board()),
            f"You are at A (row {pos[0]}, column {pos[1]}); the goal G is at "
            f"(row {goal[0]}, column {goal[1]}).",
            *([offset_text(pos, goal, cfg.offset_moves)] if cfg.show_offset else []),
            f"Round {self.round + 1} of {self.config.max_rounds}.",
        ]
        lines += round_context(
            agent,
            self.last_feedback.get(agent),
            self.state.tool_runs,
            show_tool=not cfg.single_agent and cfg.tool_task == "search",
        )
        if agent == "plan" and cfg.tool_task == "propose" and not cfg.single_agent:
            moves = self.state.proposal
            lines += ["", "The tool agent proposes:"]
            lines += [f"#### [{', '.join(moves)}]" if moves else "(no moves)"]
        lines += ["", ASK["plan" if propose else agent]]
        user = "\n".join(lines)
        if not cfg.answer_example:
            system, user = without_example(system), without_example(user)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    # --- one round ----------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "tool":
            return self._tool_turn(action)
        return self._plan_turn(action)

    def _tool_turn(self, action: str) -> RewardParts:
        """The tool's printed moves are scored on a copy: the tool never moves the team."""
        cfg, task, state = self.config, self.task, self.state
        if cfg.tool_task == "propose":
            moves = state.proposal = parse_moves(action)
            head = "" if moves is None else "Your proposal was scored."
            missing = "No moves found: end with `#### [moves]`."
        else:
            run = run_tool(action, cfg.tool_timeout)
            state.tool_runs.append(run)
            moves = parse_moves(run.output, marker="Moves:") if run.ok else None
            head, missing = run.describe(), run.describe() + "\nNo moves found in the output."
        if moves is None:
            self.last_feedback["tool"] = missing
            return RewardParts(agent=cfg.format_penalty)
        sim = score_moves(task, state.pos, moves, cfg)
        self.last_feedback["tool"] = (
            head
            + f"\nYour moves {''.join(moves)} lead to {sim.end}"
            + (" — the goal." if sim.reached else ", not the goal.")
            + (f" {past_goal(sim.after_goal)}" if sim.reached and cfg.strict_success else "")
        )
        return RewardParts(process=sim.shaping, agent=outcome_reward(sim, state.steps, task, cfg))

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
            start, steps_before = state.pos, state.steps
            out = score_moves(task, start, moves, cfg)
            state.pos, state.steps = out.end, steps_before + out.valid_moves
            state.reached, state.after_goal = out.reached, out.after_goal
            overshot = out.reached and out.after_goal > 0 and cfg.strict_success
            state.success, state.failed = out.reached and not overshot, overshot
            invalid = len(moves) - out.valid_moves if not out.reached else 0
            feedback = f"Moves {''.join(moves)} took you to {out.end}" + (
                " — the goal." if out.reached else f"; {invalid} move(s) were invalid."
            )
            if overshot:
                feedback += f" {past_goal(out.after_goal)}"
            parts = RewardParts(
                process=out.shaping, team=outcome_reward(out, steps_before, task, cfg)
            )
        self.last_feedback["plan"] = feedback + (f"\n{run.describe()}" if run is not None else "")
        return parts

    # --- pictures -----------------------------------------------------------------------------

    def render_text(self) -> str:
        status = "solved" if self.state.success else f"round {self.round}"
        return f"plan_path ({status}, {self.state.steps} steps)\n{grid.grid_text(self.board())}"

    def render_rgb(self) -> np.ndarray:
        palette = {".": (235, 235, 235), "#": (60, 60, 70), "A": (40, 120, 230), "G": (50, 180, 80)}
        return grid.render_cells(self.board(), palette)
