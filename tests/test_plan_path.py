"""Plan-path: generator, hand-computed rewards, the two-role round."""

from __future__ import annotations

import numpy as np
import pytest

import masenvs
from masenvs.envs import grid
from masenvs.envs.plan_path import PlanPathTask

TASK = {"rows": ["....", ".##.", "....", "...."], "start": [0, 0], "goal": [0, 3]}


def bfs_moves(task: PlanPathTask) -> list[str]:
    """A shortest move list, found independently of the env's own BFS."""
    free = np.array([[ch == "." for ch in row] for row in task.rows])
    dist = grid.bfs_distances(free, task.goal)
    pos, moves = task.start, []
    while pos != task.goal:
        for move in "UDLR":
            nxt = grid.step_cell(pos, move)
            if task.is_free(nxt) and dist[nxt] == dist[pos] - 1:
                pos, moves = nxt, [*moves, move]
                break
    return moves


def test_generated_tasks_are_solvable_and_optimal_length_is_bfs() -> None:
    env = masenvs.make("plan_path", size=8, single_agent=True)
    for seed in range(30):
        env.reset(seed=seed)
        task = env.task
        assert task.is_free(task.start) and task.is_free(task.goal) and task.start != task.goal
        moves = bfs_moves(task)
        assert len(moves) == task.optimal_length
        _, rewards, terms, _, infos = env.step({"plan": f"#### {moves}"})
        assert terms["plan"] and infos["plan"]["success"]
        assert infos["plan"]["reward_parts"]["team"] == pytest.approx(1.5)  # goal + optimal


def test_optimal_path_reward_by_hand() -> None:
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    _, rewards, terms, _, infos = env.step({"plan": "Going right.\n#### [R, R, R]"})
    parts = infos["plan"]["reward_parts"]
    # Shaping per move: 0.99 * (-d'/4) - (-d/4) with d = 3, 2, 1 -> 0.255 + 0.2525 + 0.25.
    assert parts["process"] == pytest.approx(0.255 + 0.2525 + 0.25 - 3 * 0.01)
    # The plan's moves are the team's: goal and optimal bonus count once, as the team part.
    assert parts["agent"] == 0.0
    assert parts["team"] == pytest.approx(1.5)
    assert rewards["plan"] == pytest.approx(0.7275 + 1.5)
    assert terms["plan"] and env.state.success


def test_prose_after_the_answer_adds_no_moves() -> None:
    # SmolLM2 keeps talking after its answer; words like "right" or a letter "D" in that
    # prose are not moves (they were, before issue 33: `#### [R, R, R]` + "go down" was RRRD).
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    _, _, terms, _, infos = env.step({"plan": "#### [R, R, R]\n\nThen go down, D is next."})
    assert terms["plan"] and infos["plan"]["success"]
    assert infos["plan"]["reward_parts"]["team"] == pytest.approx(1.5)  # 3 moves: optimal
    env.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = env.step({"plan": "#### R\nand right and right again"})
    assert env.state.pos == (0, 1) and not infos["plan"]["success"]


def test_invalid_move_and_detour_by_hand() -> None:
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    _, _, terms, _, infos = env.step({"plan": "#### D R"})
    parts = infos["plan"]["reward_parts"]
    # D: 0.99 * -1.0 + 0.75 - 0.01; R into a wall: -0.01 - 0.1 + (0.99 * -1.0 + 1.0).
    assert parts["process"] == pytest.approx(-0.25 - 0.10)
    assert parts["agent"] == 0 and parts["team"] == 0
    assert env.state.pos == (1, 0) and not terms["plan"]
    assert "1 move(s) were invalid" in infos["plan"]["messages"][-1]["content"]


def test_non_optimal_path_gets_no_optimal_bonus() -> None:
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    env.step({"plan": "#### [D]"})
    _, _, _, _, infos = env.step({"plan": "#### [U, R, R, R]"})
    assert infos["plan"]["success"] and infos["plan"]["reward_parts"]["team"] == pytest.approx(1.0)


def test_without_stop_at_goal_an_answer_must_end_on_the_goal() -> None:
    # Issue 33: with the default, moves after G are ignored, so a fixed sweep that passes
    # through G is a success; stop_at_goal=False walks every move, and only the end counts.
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = env.step({"plan": "#### [R, R, R, D]"})
    assert infos["plan"]["success"]
    env = masenvs.make("plan_path", single_agent=True, stop_at_goal=False, max_rounds=1)
    env.reset(seed=0, options={"task": TASK})
    _, _, terms, truncs, infos = env.step({"plan": "#### [R, R, R, D]"})
    assert not infos["plan"]["success"] and env.state.pos == (1, 3)
    assert infos["plan"]["reward_parts"]["team"] == 0.0
    env.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = env.step({"plan": "#### [R, R, R, D, U]"})
    assert infos["plan"]["success"] and env.state.pos == (0, 3)
    assert infos["plan"]["reward_parts"]["team"] == pytest.approx(1.0)  # 5 moves: not optimal


def test_unparsable_answer_is_a_format_penalty() -> None:
    env = masenvs.make("plan_path", single_agent=True)
    env.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = env.step({"plan": "I would go right a few times."})
    assert infos["plan"]["reward_parts"]["agent"] == -1.0
    assert env.state.pos == (0, 0)


def test_plan_sees_the_tools_program_and_output_in_the_same_round() -> None:
    env = masenvs.make("plan_path")
    env.reset(seed=0, options={"task": TASK})
    assert env.acting == "tool"
    tool = "```python\nprint('Moves: ' + str(['R'] * 3))\n```"
    obs, rewards, _, _, infos = env.step({"tool": tool})
    assert infos["tool"]["reward_parts"]["agent"] == pytest.approx(1.5)  # its moves reach G
    assert infos["tool"]["reward_parts"]["team"] == 0.0  # the tool never moves the team
    assert env.acting == "plan" and env.round == 0
    plan_prompt = infos["plan"]["messages"][-1]["content"]
    assert "Round 1 of 4" in plan_prompt
    assert "print('Moves: ' + str(['R'] * 3))" in plan_prompt  # the program of this round
    assert "Moves: ['R', 'R', 'R']" in plan_prompt  # and what it printed
    assert obs["plan"].endswith(plan_prompt)

    _, rewards, terms, _, infos = env.step({"plan": "#### [R, R, R]"})
    assert terms["plan"] and env.round == 1
    # Both agents get the team's outcome once, at the step that decides it.
    assert infos["plan"]["reward_parts"]["team"] == pytest.approx(1.5)
    assert infos["tool"]["reward_parts"] == {"process": 0.0, "agent": 0.0, "team": 1.5}
    assert rewards["tool"] == pytest.approx(1.5)


def test_simultaneous_turns_show_the_tool_output_only_next_round() -> None:
    env = masenvs.make("plan_path", turn_order="simultaneous")
    env.reset(seed=0, options={"task": TASK})
    tool = "```python\nprint('Moves: [D]')\n```"
    _, _, _, _, infos = env.step({"tool": tool})
    assert env.acting == "plan"
    assert "Moves: [D]" not in infos["plan"]["messages"][-1]["content"]
    _, _, _, _, infos = env.step({"plan": "no idea"})
    assert env.round == 1 and "Moves: [D]" in infos["plan"]["messages"][-1]["content"]


def test_a_scripted_round_sums_its_steps() -> None:
    env = masenvs.make("plan_path")
    env.reset(seed=0, options={"task": TASK})
    tool = "```python\nprint('Moves: [R, R, R]')\n```"
    _, rewards, _, _, infos = masenvs.play_round(env, {"tool": tool, "plan": "no idea"})
    assert infos["tool"]["reward_parts"]["agent"] == pytest.approx(1.5)
    assert infos["plan"]["reward_parts"]["agent"] == -1.0
    assert infos["tool"]["reward_parts"]["team"] == 0.0  # the team did not move
    assert rewards == {
        "tool": pytest.approx(infos["tool"]["reward_parts"]["process"] + 1.5),
        "plan": -1.0,
    }


def test_bad_task_option_is_a_clear_error() -> None:
    env = masenvs.make("plan_path")
    with pytest.raises(ValueError, match="not reachable"):
        env.reset(options={"task": {"rows": [".#", "#."], "start": [0, 0], "goal": [1, 1]}})


def test_proposing_tool_is_scored_on_a_copy_and_shown_to_plan() -> None:
    env = masenvs.make("plan_path", tool_task="propose", max_rounds=2)
    _, infos = env.reset(options={"task": TASK})
    assert "####" in infos["tool"]["messages"][1]["content"]  # asked for moves, not a program
    _, rewards, _, _, infos = env.step({"tool": "#### [R, R, R]"})
    parts = infos["tool"]["reward_parts"]
    assert parts["agent"] == pytest.approx(1.5)  # goal + optimal, on a copy of the board
    assert env.state.pos == (0, 0) and not env.state.tool_runs  # no move made, no program run
    assert "The tool agent proposes:\n#### [R, R, R]" in infos["plan"]["messages"][1]["content"]
    _, rewards, terms, _, infos = env.step({"plan": "#### [R, R, R]"})
    assert terms["plan"] and infos["plan"]["success"]


def test_proposing_tool_without_moves_gets_the_format_penalty() -> None:
    env = masenvs.make("plan_path", tool_task="propose")
    env.reset(options={"task": TASK})
    _, rewards, _, _, infos = env.step({"tool": "I cannot tell."})
    assert rewards["tool"] == pytest.approx(-1.0)
    assert "The tool agent proposes:\n(no moves)" in infos["plan"]["messages"][1]["content"]


def test_offset_line_says_where_the_goal_lies() -> None:
    env = masenvs.make("plan_path", show_offset=True)
    task = {"rows": ["....", "....", "....", "...."], "start": [1, 3], "goal": [3, 2]}
    _, infos = env.reset(options={"task": task})
    text = "G is 2 rows down and 1 column left of A: D, D, L if no wall is in the way."
    assert text in infos["plan"]["messages"][1]["content"]
    _, infos = env.reset(options={"task": {**task, "goal": [0, 3]}})
    assert "G is 1 row up of A: U if" in infos["plan"]["messages"][1]["content"]
    _, infos = masenvs.make("plan_path").reset(options={"task": task})
    assert "of A." not in infos["plan"]["messages"][1]["content"]
    # offset_moves=False: only where G lies; turning it into moves is the agents' job
    words = masenvs.make("plan_path", show_offset=True, offset_moves=False)
    _, infos = words.reset(options={"task": task})
    prompt = infos["plan"]["messages"][1]["content"]
    assert "G is 2 rows down and 1 column left of A.\n" in prompt and "D, D, L" not in prompt


def test_without_answer_example_no_prompt_holds_moves_to_copy() -> None:
    # Issue 33: the greedy base model answers the prompt's example `#### [R, D, D]` on every
    # task; answer_example=False describes the format in words instead.
    for single_agent, tool_task in ((False, "propose"), (False, "search"), (True, "search")):
        env = masenvs.make(
            "plan_path", answer_example=False, single_agent=single_agent, tool_task=tool_task
        )
        env.reset(seed=0, options={"task": TASK})
        for agent in env.roles if not single_agent else ("plan",):
            text = " ".join(m["content"] for m in env.prompt(agent))
            assert "[R, D, D]" not in text and "[R, R, D]" not in text, (agent, text)
            assert "####" in text or agent == "tool" and tool_task == "search"
    env = masenvs.make("plan_path", tool_task="propose")
    env.reset(seed=0, options={"task": TASK})
    assert "#### [R, D, D]" in env.prompt("plan")[1]["content"]  # the default is unchanged


# --- max_distance: a curriculum of near goals ---------------------------------------------


def test_max_distance_draws_only_near_goals_and_none_keeps_every_task() -> None:
    from masenvs.envs.plan_path import generate_task

    lengths = []
    for seed in range(40):
        env = masenvs.make("plan_path", size=4, obstacle_ratio=0.1, max_distance=2)
        env.reset(seed=seed)
        lengths.append(env.task.optimal_length)
        assert 1 <= env.task.optimal_length <= 2
    assert set(lengths) == {1, 2}
    # Without it, the same seeds draw the same tasks as before the option existed.
    for seed in range(10):
        env = masenvs.make("plan_path", size=4, obstacle_ratio=0.1)
        env.reset(seed=seed)
        assert env.task == generate_task(np.random.default_rng(seed), 4, 0.1)


def test_free_moves_into_the_edge_past_the_goal_warn_and_strict_success_fails_them() -> None:
    # Issue 46: with every move walked, invalid moves free and success not strict, an answer
    # that reaches G on the edge and keeps walking into it still ends on G: RL learned to pad.
    free = {"stop_at_goal": False, "invalid_move": 0.0, "step_cost": 0.0, "shaping": 0.0}
    padded = "#### [R, R, R, R, R, R]"  # G at (0, 3) on the right edge: three more R stay on it
    with pytest.warns(UserWarning, match="strict_success=true"):
        env = masenvs.make("plan_path", single_agent=True, max_rounds=1, **free)
    env.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = env.step({"plan": padded})
    assert infos["plan"]["success"] and env.episode_metrics()["exact_stop"] == 0.0
    strict = masenvs.make("plan_path", single_agent=True, max_rounds=1, strict_success=True, **free)
    strict.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = strict.step({"plan": padded})
    assert not infos["plan"]["success"] and infos["plan"]["reward_parts"]["team"] == 0.0
    strict.reset(seed=0, options={"task": TASK})
    _, _, _, _, infos = strict.step({"plan": "#### [R, R, R]"})
    assert infos["plan"]["success"]
