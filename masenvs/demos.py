"""Solver demonstrations: each agent's turn as the env prompts it, hint-free, answered by the
task's exact solver in the format the env parses (plan-path: a BFS shortest path; Sudoku: the
unique solution; Sokoban: a BFS shortest solution; a tool agent that writes code: a program
that finds and prints that answer), and played so the env accepts it.

`masenvs demos` writes them for `masenvs sft` (a cold start). The solvers are called here and
nowhere else: no env, observation or tool of a rollout reaches them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from masenvs.demo_programs import PRINTS, program_reply
from masenvs.env import MASEnv
from masenvs.envs import grid
from masenvs.registry import make

# Env options that put (part of) the answer into a prompt: demonstrations never set them.
HINTS: dict[str, tuple[str, ...]] = {
    "plan_path": ("show_offset",),
    "sudoku": ("show_candidates", "show_empty"),
    "sokoban": ("show_offset",),
}


class DemoError(ValueError):
    """Demonstrations that cannot be written; the message names the cause and the fix."""


# --- the solvers ----------------------------------------------------------------------------


def shortest_path(env: Any) -> list[str]:
    """A BFS-shortest move list from A to G on the current board (U, D, L, R preferred in order)."""
    task = env.task
    free = np.array([[ch == "." for ch in row] for row in task.rows])
    to_goal = grid.bfs_distances(free, task.goal)
    pos, moves = env.state.pos, []
    while pos != task.goal:
        move = next(
            m
            for m in grid.DELTAS
            if task.is_free(nxt := grid.step_cell(pos, m)) and to_goal[nxt] == to_goal[pos] - 1
        )
        moves.append(move)
        pos = grid.step_cell(pos, move)
    return moves


def wrong_proposal(env: Any, rng: np.random.Generator) -> str:
    """A move list a tool agent might get wrong: the shortest path with one move changed, dropped
    or added, such that the walk (walls and the edge stop it) never touches G."""
    task, path = env.task, shortest_path(env)
    for _ in range(1000):
        moves, i = list(path), int(rng.integers(len(path) + 1))
        kind = int(rng.integers(3))
        if kind == 0 and i < len(moves):
            moves[i] = str(rng.choice([m for m in grid.DELTAS if m != moves[i]]))
        elif kind == 1 and i < len(moves) and len(moves) > 1:
            del moves[i]
        else:
            moves.insert(i, str(rng.choice(list(grid.DELTAS))))
        pos, touched = env.state.pos, False
        for move in moves:
            nxt = grid.step_cell(pos, move)
            pos = nxt if task.is_free(nxt) else pos
            touched |= pos == task.goal
        if not touched:
            return f"#### [{', '.join(moves)}]"
    raise DemoError("found no wrong proposal in 1000 tries")  # e.g. G next to A in a dead end


def plan_path_answer(env: Any) -> str:
    return f"[{', '.join(shortest_path(env))}]"


def plan_path_working(env: Any) -> str:
    """The worked step before plan-path's moves: where A and G are, read from the grid the
    prompt shows, and the offset between them (what `show_offset` would have given away)."""
    (ar, ac), (gr, gc) = env.state.pos, env.task.goal
    steps = [
        f"{abs(d)} {word}"
        for d, word in (
            (gr - ar, "down" if gr > ar else "up"),
            (gc - ac, "right" if gc > ac else "left"),
        )
        if d
    ]
    return f"A is at row {ar}, column {ac}; G is at row {gr}, column {gc}: {', '.join(steps)}."


def plan_path_worked(env: Any) -> str:
    return f"{plan_path_working(env)} #### {plan_path_answer(env)}"


def sudoku_answer(env: Any) -> str:
    from masenvs.envs.sudoku_solver import solutions

    n = env.task.size
    found = solutions([v for row in env.state.board for v in row], n, 1)
    if not found:
        raise DemoError("the sudoku board has no solution")
    return json.dumps([found[0][r * n : (r + 1) * n] for r in range(n)])


def sudoku_worked(env: Any) -> str:
    """Sudoku's worked answer: for each empty cell in reading order, a row, column or box (in that
    order of preference) whose other digits are all on the board (earlier fills in), those
    digits, and the one missing; then the fills `#### [[row, column, value], ...]`."""
    n, b = env.task.size, math.isqrt(env.task.size)
    board = [list(row) for row in env.state.board]
    solution = json.loads(sudoku_answer(env))
    steps, fills = [], []
    for r, c in [(r, c) for r in range(n) for c in range(n) if board[r][c] == 0]:
        value = solution[r][c]
        named = [
            ("Row", r, [(r, k) for k in range(n)]),
            ("Column", c, [(k, c) for k in range(n)]),
            (
                "Box",
                (r // b) * b + c // b,
                [(r - r % b + k // b, c - c % b + k % b) for k in range(n)],
            ),
        ]
        for unit, index, cells in named:
            others = [board[i][j] for i, j in cells if (i, j) != (r, c)]
            if all(others):
                digits = ", ".join(map(str, others))
                steps.append(f"{unit} {index} has {digits}: row {r}, column {c} is {value}.")
                break
        else:
            steps.append(f"Row {r}, column {c} is {value}.")
        board[r][c] = value
        fills.append([r, c, value])
    return f"{' '.join(steps)} #### {json.dumps(fills)}"


def sokoban_answer(env: Any) -> str:
    from dataclasses import replace

    from masenvs.envs.sokoban_solver import solve

    now = replace(env.task, player=env.state.player, boxes=tuple(sorted(env.state.boxes)))
    found = solve(now, env.config.solver_states)
    if found.moves is None:
        raise DemoError(
            f"the Sokoban solver found no solution within {env.config.solver_states} states: "
            "raise --set solver_states=..."
        )
    return f"[{', '.join(found.moves)}]"


# env -> its solver's answer on the current state, as the env parses it after `####`
SOLVERS: dict[str, Callable[[Any], str]] = {
    "plan_path": plan_path_answer,
    "sudoku": sudoku_answer,
    "sokoban": sokoban_answer,
}


def writes_program(env: MASEnv, agent: str) -> bool:
    """The agent's role is a program (the tool agent, unless plan-path's tool proposes moves)."""
    tool_task = getattr(env.config, "tool_task", "search")
    return agent == "tool" and not env.config.single_agent and tool_task == "search"


# env -> its worked reply: what it reads off the board, then `#### answer` (`masenvs demos --explain`)
WORKED: dict[str, Callable[[Any], str]] = {"plan_path": plan_path_worked, "sudoku": sudoku_worked}


def solver_reply(env: MASEnv, agent: str, explain: bool = False) -> str:
    """The solver's answer for `agent` on the env's current state, in the form the env reads:
    `#### answer` (after the worked step with `explain`), or for a role that writes a program,
    a program that prints the answer."""
    if writes_program(env, agent):
        board = env.state.board if env.name == "sudoku" else env.board()
        return program_reply(env.name, board)
    return WORKED[env.name](env) if explain else f"#### {SOLVERS[env.name](env)}"


# --- demonstrations -------------------------------------------------------------------------


def proposes(env: MASEnv, agent: str) -> bool:
    """The agent is plan-path's tool agent proposing moves, which the plan agent then reads."""
    tool_task = getattr(env.config, "tool_task", None)
    return env.name == "plan_path" and agent == "tool" and tool_task == "propose"


def demo_env(
    env_name: str, options: dict[str, Any], explain: bool = False, wrong: float = 0.0
) -> MASEnv:
    """The env demonstrations are written in: one with a solver, and hint-free."""
    if not 0 <= wrong <= 1:
        raise DemoError(f"--wrong-proposals {wrong}: a share of the episodes, between 0 and 1")
    if env_name not in SOLVERS:
        raise DemoError(
            f"no solver for {env_name!r}: demonstrations exist for {', '.join(sorted(SOLVERS))}"
        )
    if explain and env_name not in WORKED:
        raise DemoError(
            f"--explain: worked answers exist for {', '.join(sorted(WORKED))}, not {env_name}"
        )
    for option in HINTS[env_name]:
        if options.get(option):
            raise DemoError(
                f"demonstrations are hint-free: {env_name} with {option}=true puts part of the "
                f"answer into the prompt; drop it (or --set {option}=false)"
            )
    env = make(env_name, **options)
    hinted = [o for o in HINTS[env_name] if getattr(env.config, o)]
    if hinted:  # a default that turns a hint on
        raise DemoError(f"{env_name}'s {hinted[0]} is on: --set {hinted[0]}=false")
    if wrong and (env.config.single_agent or not proposes(env, "tool")):
        raise DemoError(
            "--wrong-proposals: a plan agent reads a tool agent's move list only in plan-path's "
            "team with tool_task: propose"
        )
    return env


def demo_row(
    env: MASEnv, agent: str, prompt: list[dict], reply: str, seed: int, round_: int
) -> dict[str, Any]:
    """One line of `masenvs demos`: the agent's prompt, then the solver's reply."""
    messages = [*prompt, {"role": "assistant", "content": reply}]
    return {"agent": agent, "messages": messages, "env": env.name, "seed": seed, "round": round_}


def episode_demos(
    env: MASEnv, seed: int, explain: bool = False, wrong: float = 0.0
) -> list[dict[str, Any]]:
    """Every agent turn of seed's episode, each answered by the solver (after its worked step
    with `explain`) and played, until the episode ends; an answer the env does not accept
    raises DemoError. With `wrong`, that share of the episodes (drawn from the seed) play a
    wrong tool proposal instead: the tool's line is still the solver's answer to its prompt
    (which what is played cannot change), and the plan agent's line answers right despite it."""
    _, infos = env.reset(seed=seed)
    rows, rng = [], np.random.default_rng([seed, 46])
    while env.agents:
        agent, round_ = env.acting, env.round
        prompt = infos[agent]["messages"]
        try:
            reply, answer = solver_reply(env, agent, explain), SOLVERS[env.name](env)
        except DemoError as exc:
            raise DemoError(f"seed {seed}: {exc}") from None
        if wrong and proposes(env, agent) and rng.random() < wrong:
            _, _, _, _, infos = env.step({agent: wrong_proposal(env, rng)})
            rows.append(demo_row(env, agent, prompt, reply, seed, round_))
            continue
        _, _, _, _, infos = env.step({agent: reply})
        printed = f"{PRINTS[env.name]} {answer}"
        if infos[agent]["reward_parts"]["agent"] < 0 or (  # a format, rule or clue penalty
            writes_program(env, agent) and env.state.tool_runs[-1].output.strip() != printed
        ):
            raise DemoError(
                f"{env.name} did not accept the solver's reply {reply[:300]!r} to {agent} on seed "
                f"{seed} (a program must print {printed!r}): {env.last_feedback.get(agent)}"
            )
        rows.append(demo_row(env, agent, prompt, reply, seed, round_))
    if not env.state.success:
        raise DemoError(
            f"{env.name} did not accept the solver's replies on seed {seed}: the episode ended "
            "without success"
        )
    return rows
