"""Sudoku: unique-solution generator, parser, hand-computed rewards, the two-role round."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pettingzoo.test import parallel_api_test

import masenvs
from masenvs.envs.sudoku import SudokuTask, is_solved, parse_answer, violations

PUZZLE = ["12..", "34..", "..4.", "...1"]
SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
TASK = {"puzzle": PUZZLE}


def count_solutions(puzzle: tuple[tuple[int, ...], ...], limit: int = 3) -> int:
    """Solutions by exact cover (Knuth's Algorithm X), independent of the env's solver."""
    n = len(puzzle)
    b = math.isqrt(n)
    rows = {
        (r, c, v): [("cell", r, c), ("row", r, v), ("col", c, v), ("box", r // b * b + c // b, v)]
        for r in range(n)
        for c in range(n)
        for v in range(1, n + 1)
    }
    columns: dict[tuple, set] = {}
    for key, cols in rows.items():
        for col in cols:
            columns.setdefault(col, set()).add(key)

    def select(key: tuple) -> list[set]:
        removed = []
        for col in rows[key]:
            for other in columns[col]:
                for other_col in rows[other]:
                    if other_col != col:
                        columns[other_col].discard(other)
            removed.append(columns.pop(col))
        return removed

    def deselect(key: tuple, removed: list[set]) -> None:
        for col in reversed(rows[key]):
            columns[col] = removed.pop()
            for other in columns[col]:
                for other_col in rows[other]:
                    if other_col != col:
                        columns[other_col].add(other)

    for r in range(n):
        for c in range(n):
            if puzzle[r][c]:
                if any(col not in columns for col in rows[r, c, puzzle[r][c]]):
                    return 0  # two clues clash
                select((r, c, puzzle[r][c]))

    def search() -> int:
        if not columns:
            return 1
        col = min(columns, key=lambda k: len(columns[k]))
        total = 0
        for key in sorted(columns[col]):
            removed = select(key)
            total += search()
            deselect(key, removed)
            if total >= limit:
                break
        return total

    return search()


def grid_answer(rows: list[list[int]]) -> str:
    return "Here is the grid.\n####\n" + "\n".join(" ".join(map(str, row)) for row in rows)


# --- the PettingZoo contract ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"size": 4},
        {"size": 9},
        {"size": 4, "single_agent": True},
        {"size": 9, "single_agent": True},
    ],
    ids=["4x4", "9x9", "4x4-single", "9x9-single"],
)
def test_parallel_api(config: dict) -> None:
    parallel_api_test(masenvs.make("sudoku", **config), num_cycles=5)


@pytest.mark.parametrize("size", [4, 9])
def test_same_seed_same_task_and_observations(size: int) -> None:
    a, b = masenvs.make("sudoku", size=size), masenvs.make("sudoku", size=size)
    obs_a, _ = a.reset(seed=11)
    obs_b, _ = b.reset(seed=11)
    assert a.task == b.task and obs_a == obs_b
    action = {"tool": "nothing", "plan": "#### [[0, 0, 1], [1, 1, 2]]"}
    assert a.step(action)[:2] == b.step(action)[:2]
    puzzles = set()
    for seed in range(10):
        a.reset(seed=seed)
        puzzles.add(a.task.puzzle)
    assert len(puzzles) == 10


def test_snapshot_restore_gives_identical_futures() -> None:
    env = masenvs.make("sudoku", size=9, max_rounds=4)
    env.reset(seed=3)
    env.step({"tool": "", "plan": "#### [[0, 0, 1]]"})
    snap = env.snapshot()
    fills = [[r, c, env.task.solution[r][c]] for r in range(9) for c in range(9)][:40]
    actions = {"tool": "no code", "plan": f"#### {json.dumps(fills)}"}
    first = [env.step(actions), env.step({"tool": "", "plan": "#### [[8, 8, 0]]"})]
    env.restore(snap)
    second = [env.step(actions), env.step({"tool": "", "plan": "#### [[8, 8, 0]]"})]
    assert first == second
    assert first[0][4]["plan"]["reward_parts"]["process"] > 0  # the fills made progress


# --- rewards, computed by hand on PUZZLE (10 empty cells of 16) -----------------------------


def play(action: str, env=None):
    env = env or masenvs.make("sudoku", single_agent=True)
    if not env.agents:
        env.reset(seed=0, options={"task": TASK})
    _, rewards, terms, _, infos = env.step({"plan": action})
    return env, rewards["plan"], terms["plan"], infos["plan"]


def test_one_correct_fill_is_progress() -> None:
    env, reward, done, info = play("#### [[0, 2, 3]]")
    assert info["reward_parts"] == pytest.approx(
        {"process": -0.01 + 0.5 * 1 / 16, "agent": 0.0, "team": 0.0}
    )
    assert reward == pytest.approx(0.02125) and not done
    assert env.state.board[0] == [1, 2, 3, 0]


def test_fills_accumulate_and_clearing_a_correct_cell_costs_progress() -> None:
    env, *_ = play("#### [[0, 2, 3]]")
    env, _, _, info = play("#### [[0, 3, 4]]", env)
    assert env.state.board[0] == [1, 2, 3, 4]
    env, _, _, info = play("#### [[0, 3, 0]]", env)  # 0 clears a cell
    assert env.state.board[0] == [1, 2, 3, 0]
    assert info["reward_parts"]["process"] == pytest.approx(-0.01 - 0.5 / 16)


def test_conflicting_value_is_penalised() -> None:
    env, _, _, info = play("#### [[0, 2, 1]]")  # row 0 already holds a 1
    assert info["reward_parts"] == pytest.approx(
        {"process": -0.01 - 0.02, "agent": -0.5, "team": 0}
    )
    assert "breaks the rules 1 time" in info["messages"][-1]["content"]
    env, _, _, info = play(
        "#### [[0, 2, 3]]", env
    )  # fixing it: one correct cell, one violation fewer
    assert info["reward_parts"] == pytest.approx(
        {"process": -0.01 + 0.5 / 16 + 0.02, "agent": 0.0, "team": 0.0}
    )


def test_changing_a_clue_is_penalised_and_ignored() -> None:
    env, _, _, info = play("#### [[0, 0, 2]]")
    assert info["reward_parts"] == pytest.approx({"process": -0.01, "agent": -0.5, "team": 0.0})
    assert env.state.board[0][0] == 1


def test_full_solution_solves_with_bonus() -> None:
    env, reward, done, info = play(grid_answer(SOLUTION))
    assert info["reward_parts"] == pytest.approx(
        {"process": -0.01 + 0.5 * 10 / 16, "agent": 0.0, "team": 2.0}
    )  # the solved bonus counts once: the plan's grid is the team's
    assert done and info["success"] and reward == pytest.approx(2.3025)


def test_a_valid_grid_that_ignores_the_clues_is_not_solved() -> None:
    relabeled = [[{1: 2, 2: 1}.get(v, v) for v in row] for row in SOLUTION]  # swap digits 1 and 2
    puzzle = tuple(tuple(int(ch) if ch != "." else 0 for ch in row) for row in PUZZLE)
    assert violations(relabeled) == 0 and all(all(row) for row in relabeled)
    assert not is_solved(relabeled, puzzle)  # the reference implementation said True here
    assert is_solved(SOLUTION, puzzle)
    env, _, done, info = play(grid_answer(relabeled))
    assert not done and not info["success"]
    assert info["reward_parts"]["agent"] <= -0.5  # changed clues at least


def test_unparsable_answer_is_a_format_penalty() -> None:
    env, reward, _, info = play("I think the first row ends with 3 4.")
    assert info["reward_parts"] == {"process": 0.0, "agent": -1.5, "team": 0.0}
    assert env.state.board[0] == [1, 2, 0, 0]


def test_an_unparsable_answer_pays_less_than_any_full_grid_that_is_wrong() -> None:
    """RL found the hole (docs/learning.md, Sudoku cold start): with the format penalty at -1.0,
    a grid that rewrote a clue and repeated a digit (-1.0 and shaping) paid less than no grid,
    so GRPO taught the policy to stop its grid early."""
    wrong = [row[:] for row in SOLUTION]
    wrong[0][0], wrong[0][2] = 2, 2  # a clue rewritten (ignored), a digit repeated in row 0
    _, worst, _, info = play(grid_answer(wrong))
    assert info["reward_parts"]["agent"] == -1.0  # both penalties
    _, unparsable, _, _ = play("####\n[[1, 2, 3, 4], [3, 4, 1, 2]]")  # the grid cut short
    assert unparsable < worst
    # a config that opens the hole again says so
    with pytest.warns(UserWarning, match="stop its grid early"):
        masenvs.make("sudoku", format_penalty=-1.0)


def test_configured_rewards_are_used() -> None:
    env = masenvs.make("sudoku", single_agent=True, solved_bonus=5.0, step_cost=0.0)
    env.reset(options={"task": TASK})
    _, _, _, info = play(grid_answer(SOLUTION), env)
    assert info["reward_parts"] == pytest.approx({"process": 0.3125, "agent": 0.0, "team": 5.0})


# --- parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "####\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
        "#### [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]",
        "#### [1,2,3,4,3,4,1,2,2,1,4,3,4,3,2,1]",
        "####\n```\n12|34\n34|12\n--+--\n21|43\n43|21\n```\nDone!",
        "the grid: [['1','2','3','4'],['3','4','1','2'],['2','1','4','3'],['4','3','2','1']]",
        "#### draft: 9999\n#### [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]] (checked [ok])",
    ],
)
def test_parser_reads_grids_in_many_shapes(text: str) -> None:
    answer = parse_answer(text, 4)
    assert answer is not None and answer.dropped == 0
    assert {(r, c): v for r, c, v in answer.fills} == {
        (r, c): SOLUTION[r][c] for r in range(4) for c in range(4)
    }


def test_parser_reads_fills_and_drops_bad_entries() -> None:
    answer = parse_answer("#### [[0, 2, 3], [1, 3, 2], [9, 9, 9], [0, 0, 'x']]", 4)
    assert answer is not None
    assert answer.fills == [(0, 2, 3), (1, 3, 2)] and answer.dropped == 2
    assert parse_answer("#### [3, 3, 1]", 4).fills == [(3, 3, 1)]
    assert parse_answer("####\n1 . . 4\n. . . .\n_ _ _ _\n. . . 1", 4).fills[:4] == [
        (0, 0, 1),
        (0, 1, 0),
        (0, 2, 0),
        (0, 3, 4),
    ]


@pytest.mark.parametrize(
    "text", ["", "####", "#### [[1, 2], [3]]", "#### 1 2 3", "#### [[9, 9, 9]]", "[" * 5000]
)
def test_parser_returns_none_for_no_answer(text: str) -> None:
    assert parse_answer(text, 4) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=10),
    max_leaves=90,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, size=st.sampled_from([4, 9]))
def test_parser_never_raises_on_any_json(value, size: int) -> None:
    answer = parse_answer(f"#### {json.dumps(value)}", size)
    if answer is not None:
        assert all(0 <= r < size and 0 <= c < size and 0 <= v <= size for r, c, v in answer.fills)


# --- generator ------------------------------------------------------------------------------


@pytest.mark.parametrize("size, seeds", [(4, 40), (9, 12)])
def test_generated_puzzles_have_exactly_one_solution(size: int, seeds: int) -> None:
    env = masenvs.make("sudoku", size=size, single_agent=True)
    for seed in range(seeds):
        env.reset(seed=seed)
        task = env.task
        assert count_solutions(task.puzzle) == 1
        assert count_solutions(task.solution) == 1  # the solution is a valid full grid
        assert all(
            v == task.solution[r][c]
            for r, row in enumerate(task.puzzle)
            for c, v in enumerate(row)
            if v
        )
        assert task.clues == {4: 6, 9: 30}[size]
        _, _, done, info = play(grid_answer([list(row) for row in task.solution]), env)
        assert done and info["success"]


def test_clues_config_sets_difficulty() -> None:
    env = masenvs.make("sudoku", size=9, clues=26)
    env.reset(seed=1)
    assert env.task.clues >= 26 and count_solutions(env.task.puzzle) == 1
    assert env.task_info()["empty_cells"] == 81 - env.task.clues


def test_bad_tasks_and_configs_fail_clearly() -> None:
    env = masenvs.make("sudoku")
    with pytest.raises(ValueError, match="more than one solution"):
        env.reset(options={"task": {"puzzle": ["1...", "....", "....", "...."]}})
    with pytest.raises(ValueError, match="no solution"):
        env.reset(options={"task": {"puzzle": ["11..", "....", "....", "...."]}})
    with pytest.raises(ValueError, match="4 or 9 rows"):
        env.reset(options={"task": {"puzzle": ["123", "231", "312"]}})
    with pytest.raises(ValueError, match="not a digit"):
        env.reset(options={"task": {"puzzle": ["12..", "34..", "..4.", "..x1"]}})
    with pytest.raises(ValueError, match="does not solve"):
        env.reset(options={"task": {"puzzle": PUZZLE, "solution": [[1] * 4] * 4}})
    with pytest.raises(ValueError, match="SudokuTask or a dict"):
        env.reset(options={"task": "12..34....4....1"})
    with pytest.raises(ValueError, match="size"):
        masenvs.make("sudoku", size=5)
    with pytest.raises(ValueError, match="exceeds"):
        masenvs.make("sudoku", size=4, clues=17)


def test_task_object_and_dict_round_trip() -> None:
    env = masenvs.make("sudoku", size=9)
    env.reset(seed=4)
    task = env.task
    env.reset(options={"task": task.to_dict()})
    assert env.task == task
    env.reset(options={"task": task})
    assert env.task is task and isinstance(task, SudokuTask)


# --- the two roles --------------------------------------------------------------------------


def test_tool_program_output_is_scored_and_shown_to_plan() -> None:
    env = masenvs.make("sudoku")
    env.reset(seed=0, options={"task": TASK})
    tool = f"```python\nprint('Solution:', {SOLUTION!r})\n```"
    obs, _, _, _, infos = env.step({"tool": tool})
    assert infos["tool"]["reward_parts"] == pytest.approx(
        {"process": -0.01 + 0.5 * 10 / 16, "agent": 2.0, "team": 0.0}
    )
    assert env.state.board[1] == [3, 4, 0, 0]  # the tool's grid was only simulated
    # The plan, due next in the same round, sees the program and what it printed.
    assert env.acting == "plan" and env.round == 0
    assert "Solution: [[1, 2, 3, 4]" in obs["plan"] and "print(" in obs["plan"]
    _, _, terms, _, infos = env.step({"plan": "no idea"})
    assert infos["plan"]["reward_parts"]["agent"] == -1.5 and not terms["plan"]
    _, _, terms, _, infos = masenvs.play_round(env, {"tool": "", "plan": grid_answer(SOLUTION)})
    assert terms["tool"] and infos["tool"]["reward_parts"]["team"] == 2.0


def test_render_rgb_and_ansi() -> None:
    for size in (4, 9):
        env = masenvs.make("sudoku", size=size, render_mode="rgb_array")
        env.reset(seed=2)
        image = env.render()
        assert image.shape == (size * 24, size * 24, 3) and image.dtype == np.uint8
        assert len(np.unique(image.reshape(-1, 3), axis=0)) > 3
    env = masenvs.make("sudoku", render_mode="ansi")
    env.reset(seed=2)
    assert env.render().startswith("sudoku (round 0)")


# --- any text is a legal action ---------------------------------------------------------------

_TEXT = st.one_of(
    st.text(max_size=400),
    st.binary(max_size=400).map(lambda b: b.decode("latin-1")),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=20),
    st.sampled_from(["", "####", "#### [[", "#### " + "[" * 10_000, "#### 1 2\n3 4", "\x00\xff"]),
    st.just("1 2 3 4\n" * 131_072),  # 1 MiB
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_TEXT, min_size=2, max_size=2), size=st.sampled_from([4, 9]))
def test_any_text_is_a_legal_action(texts: list[str], size: int) -> None:
    env = masenvs.make("sudoku", size=size, single_agent=True, max_rounds=2)
    env.reset(seed=0)
    while env.agents:
        _, rewards, *_ = env.step({"plan": texts[env.round]})
        assert np.isfinite(rewards["plan"])


# --- show_candidates: each empty cell's candidates, as fills --------------------------------


def test_show_candidates_lists_each_empty_cell_and_its_digits() -> None:
    env = masenvs.make("sudoku", single_agent=True, show_candidates=True)
    _, infos = env.reset(seed=0, options={"task": TASK})
    prompt = infos["plan"]["messages"][-1]["content"]
    # Row 0 holds 1, 2; column 2 holds 4; box 1 (rows 0-1, columns 2-3) holds nothing: 3.
    assert "[0, 2, 3] (only 3 fits)" in prompt
    # (2, 0): row 2 holds 4, column 0 holds 1, 3, box 2 holds nothing: 2.
    assert "[2, 0, 2] (only 2 fits)" in prompt
    # (3, 2): row 3 holds 1, column 2 holds 4, box 3 holds 4, 1: 2 or 3.
    assert "[3, 2, 2 or 3]" in prompt
    (line,) = [x for x in prompt.splitlines() if x.startswith("Empty cells as")]
    assert len(line.split("; ")) == 10  # one entry per empty cell
    assert prompt.endswith("#### [[row, column, value], ...]")  # no example fill to copy
    assert "Python" not in infos["plan"]["messages"][0]["content"]  # the fills alone
    assert (
        "fits"
        not in masenvs.make("sudoku", single_agent=True).reset(seed=0, options={"task": TASK})[1][
            "plan"
        ]["messages"][-1]["content"]
    )


def test_show_candidates_single_candidates_are_right_and_solve_only_when_complete() -> None:
    solution = [row[:] for row in SOLUTION]
    puzzle = [row[:] for row in solution]
    puzzle[0][3] = puzzle[1][2] = 0  # two blanks: each has one candidate
    env = masenvs.make("sudoku", single_agent=True, show_candidates=True, max_rounds=2)
    _, infos = env.reset(seed=0, options={"task": {"puzzle": puzzle}})
    prompt = infos["plan"]["messages"][-1]["content"]
    # Every cell forced: one list in the answer's form, which solves the puzzle as written.
    assert "only one digit fits each: [[0, 3, 4], [1, 2, 1]]." in prompt
    listed = prompt.split("fits each: ")[1].splitlines()[0]
    assert parse_answer(listed, 4).fills == [(0, 3, 4), (1, 2, 1)]
    assert parse_answer(prompt.rsplit("\n", 1)[1], 4) is None  # the placeholder does not parse
    _, _, _, _, infos = env.step({"plan": "#### [[0, 3, 4]]"})  # one of two: not solved
    assert not infos["plan"]["success"]
    assert "fits each: [[1, 2, 1]]." in infos["plan"]["messages"][-1]["content"]
    assert "[0, 3" not in infos["plan"]["messages"][-1]["content"]  # filled: no longer listed
    _, _, terms, _, infos = env.step({"plan": "#### [[1, 2, 1]]"})
    assert infos["plan"]["success"] and is_solved(env.state.board, env.task.puzzle)


# --- show_empty: where to answer, not what ------------------------------------------------


def test_show_empty_lists_the_cells_but_no_digit_and_a_right_fill_solves() -> None:
    puzzle = [row[:] for row in SOLUTION]
    puzzle[0][3] = puzzle[2][1] = 0
    env = masenvs.make("sudoku", single_agent=True, show_empty=True, max_rounds=2)
    _, infos = env.reset(seed=0, options={"task": {"puzzle": puzzle}})
    prompt = infos["plan"]["messages"][-1]["content"]
    assert "Empty cells as [row, column, value]: [[0, 3, ?], [2, 1, ?]]." in prompt
    assert "fits" not in prompt  # no candidate, so no digit is given away
    assert prompt.endswith("#### [[row, column, value], ...]")
    listed = prompt.split("value]: ")[1].splitlines()[0]
    assert parse_answer(listed, 4) is None  # the '?' line itself is no answer
    _, rewards, _, _, infos = env.step({"plan": "#### [[0, 3, 1], [2, 1, 1]]"})
    assert not infos["plan"]["success"] and rewards["plan"] < 0  # wrong digits: conflicts
    env.reset(seed=0, options={"task": {"puzzle": puzzle}})
    fills = f"[[0, 3, {SOLUTION[0][3]}], [2, 1, {SOLUTION[2][1]}]]"
    _, _, _, _, infos = env.step({"plan": f"#### {fills}"})
    assert infos["plan"]["success"]
    # Candidates, when also asked for, are listed instead of the '?' cells.
    both = masenvs.make("sudoku", single_agent=True, show_empty=True, show_candidates=True)
    text = both.reset(seed=0, options={"task": {"puzzle": puzzle}})[1]["plan"]["messages"][-1]
    assert "?" not in text["content"] and "fits each" in text["content"]
