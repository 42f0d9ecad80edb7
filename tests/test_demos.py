"""`masenvs demos`: solver demonstrations for a supervised cold start (issue 46): hint-free
prompts exactly as a rollout sends them, replies the env accepts, never a validation seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from masenvs.cli import main
from masenvs.demo_programs import PRINTS
from masenvs.demos import DemoError, episode_demos, solver_reply
from masenvs.registry import make
from masenvs.trainer.commands.demos import demos
from masenvs.trainer.commands.sft import read_traces, targets

ROOT = Path(__file__).resolve().parents[1]
COLD_START_SUDOKU = str(ROOT / "examples" / "learning" / "cold_start_sudoku.yaml")
COLD_START = str(ROOT / "examples" / "learning" / "cold_start_plan_path.yaml")

HINT_FREE = {
    "plan_path": {"size": 5, "tool_task": "propose"},
    "sudoku": {"size": 4, "single_agent": True},
    "sokoban": {"width": 6, "height": 6, "single_agent": True},
}
# The tool agent writes a program in these: its demonstration is a program that solves the task.
TEAMS = {
    "plan_path": {"size": 5, "tool_task": "search"},
    "sudoku": {"size": 4},
    "sokoban": {"width": 6, "height": 6},
}
CASES = [(name, options) for name in sorted(HINT_FREE) for options in (HINT_FREE, TEAMS)]
# Words that only a hint option puts into a prompt (offsets, candidates, empty-cell lists).
HINT_WORDS = ("of A", "if no wall", "only", "fits", "?]", "stand at", "its goal is")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(("env_name", "cases"), CASES)
def test_demos_replay_to_success_from_hint_free_prompts(
    env_name: str, cases: dict, tmp_path: Path
) -> None:
    out = tmp_path / "demos.jsonl"
    sets = [f"--set={k}={v}" for k, v in cases[env_name].items()]
    assert main(["demos", env_name, "--seeds", "10:14", "--out", str(out), *sets]) == 0
    rows = read(out)
    assert sorted({r["seed"] for r in rows}) == [10, 11, 12, 13]
    env = make(env_name, **cases[env_name])
    for seed in range(10, 14):
        mine = [r for r in rows if r["seed"] == seed]
        assert [r["agent"] for r in mine] == env.possible_agents  # every role's turn, in order
        _, infos = env.reset(seed=seed)
        for row in mine:
            *prompt, reply = row["messages"]
            agent = env.acting
            # the turn exactly as the env prompts it, the reply as an assistant message
            assert row["agent"] == agent and prompt == infos[agent]["messages"]
            assert reply["role"] == "assistant"
            text = "\n".join(m["content"] for m in prompt)
            assert not [w for w in HINT_WORDS if w in text], text
            _, _, _, _, infos = env.step({agent: reply["content"]})
            assert infos[agent]["reward_parts"]["agent"] >= 0  # no format or rule penalty
        assert env.state.success and not env.agents


def test_plan_path_replies_are_shortest_paths() -> None:
    env = make("plan_path", size=6, obstacle_ratio=0.3, single_agent=True)
    for seed in range(20):
        env.reset(seed=seed)
        reply = solver_reply(env, "plan")
        env.step({"plan": reply})
        assert env.state.success and env.state.steps == env.task.optimal_length, (seed, reply)
        assert env.episode_metrics()["optimal"] == 1.0


def test_explained_plan_path_replies_state_what_the_board_shows_then_the_moves(
    tmp_path: Path, capsys
) -> None:
    import re

    out = tmp_path / "demos.jsonl"
    args = ["demos", "--config", COLD_START, "--seeds", "200000:200040", "--out", str(out)]
    assert main([*args, "--explain"]) == 0
    words = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    for row in read(out):
        prompt = row["messages"][-2]["content"]
        reply = row["messages"][-1]["content"]
        # the positions it states are those of the board the prompt shows ...
        found = re.fullmatch(
            r"A is at row (\d), column (\d); G is at row (\d), column (\d): (.+)\. #### \[(.*)\]",
            reply,
        )
        assert found, reply
        ar, ac, gr, gc = map(int, found.groups()[:4])
        board = [line.split()[1:] for line in prompt.split("\n") if re.match(r" \d ", line)]
        assert board[ar][ac] == "A" and board[gr][gc] == "G", (board, reply)
        # ... the offset is G's minus A's, and the moves (a shortest path) sum to it
        offset = [0, 0]
        for part in found.group(5).split(", "):
            n, word = part.split()
            offset = [o + int(n) * d for o, d in zip(offset, words[word], strict=True)]
        assert offset == [gr - ar, gc - ac], reply
        moves = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
        walked = [sum(moves[m][i] for m in found.group(6).split(", ")) for i in (0, 1)]
        assert walked == offset, reply
        # the prompt itself states no offset: the reply works it out
        assert not re.search(r"\d (up|down|left|right)", prompt), prompt
    # Plain demonstrations are the answer alone; Sokoban has no worked step.
    assert main([*args]) == 0
    assert all(r["messages"][-1]["content"].startswith("#### [") for r in read(out))
    capsys.readouterr()
    code = main(["demos", "sokoban", "--seeds", "0:2", "--out", str(tmp_path / "s"), "--explain"])
    assert code == 2 and "worked answers exist for plan_path, sudoku" in capsys.readouterr().out


def test_explained_sudoku_replies_name_each_empty_cells_full_unit_then_the_fills(
    tmp_path: Path,
) -> None:
    import re

    out = tmp_path / "demos.jsonl"
    args = ["demos", "--config", COLD_START_SUDOKU, "--seeds", "200000:200040", "--out", str(out)]
    assert main([*args, "--explain"]) == 0
    step = re.compile(
        r"(Row|Column|Box) (\d) has (\d), (\d), (\d): row (\d), column (\d) is (\d)\."
    )
    for row in read(out):
        prompt, reply = row["messages"][-2]["content"], row["messages"][-1]["content"]
        board = json.loads(re.search(r"As a JSON list of rows \(0 = empty\): (.*)", prompt)[1])
        empty = [(r, c) for r in range(4) for c in range(4) if board[r][c] == 0]
        working, answer = reply.split(" #### ")
        fills = json.loads(answer)
        assert [(r, c) for r, c, _ in fills] == empty, reply  # every empty cell, in reading order
        steps = step.findall(working)
        assert (
            len(steps) == len(empty)
            and " ".join(
                f"{u} {i} has {a}, {b}, {c}: row {r}, column {col} is {v}."
                for u, i, a, b, c, r, col, v in steps
            )
            == working
        ), reply
        for (unit, i, *digits, r, c, v), (fr, fc, fv) in zip(steps, fills, strict=True):
            r, c, i = int(r), int(c), int(i)
            assert (r, c, int(v)) == (fr, fc, fv), reply
            # the unit holds the cell, and the digits it states are the board's (earlier fills in)
            cells = {
                "Row": [(i, k) for k in range(4)],
                "Column": [(k, i) for k in range(4)],
                "Box": [(2 * (i // 2) + k // 2, 2 * (i % 2) + k % 2) for k in range(4)],
            }[unit]
            assert (r, c) in cells, reply
            assert sorted(map(int, digits)) == sorted(
                board[a][b] for a, b in cells if (a, b) != (r, c)
            )
            assert sorted([*map(int, digits), fv]) == [1, 2, 3, 4], reply
            board[r][c] = fv
        assert "has" not in prompt  # the prompt states no unit's digits: the reply reads them


@pytest.mark.parametrize(
    ("env_name", "option"),
    [("plan_path", "show_offset"), ("sudoku", "show_candidates"), ("sudoku", "show_empty")]
    + [("sokoban", "show_offset")],
)
def test_a_hint_option_is_refused(env_name: str, option: str) -> None:
    options = {**HINT_FREE[env_name], option: True}
    with pytest.raises(DemoError, match=f"{option}=true"):
        demos(env_name, options, range(0, 2))


@pytest.mark.parametrize("env_name", sorted(TEAMS))
def test_the_tool_agent_demonstrates_a_program_that_prints_the_solvers_answer(
    env_name: str,
) -> None:
    rows = demos(env_name, TEAMS[env_name], range(3, 5))
    for tool, plan in zip(rows[::2], rows[1::2], strict=True):
        assert (tool["agent"], plan["agent"]) == ("tool", "plan")
        program = tool["messages"][-1]["content"]
        assert program.startswith("```python\n") and program.endswith("\n```")
        answer = plan["messages"][-1]["content"].removeprefix("#### ")
        # the plan agent reads the program's output: the answer it then gives
        assert f"{PRINTS[env_name]} {answer}" in plan["messages"][-2]["content"]


def test_validation_seeds_are_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demos.jsonl"
    # masenvs eval and validation draw from 1_000_000 up by default
    code = main(["demos", "plan_path", "--seeds", "999998:1000002", "--out", str(out)])
    assert code == 2 and not out.exists()
    said = capsys.readouterr().out
    assert "1000000" in said and "validation" in said
    # a config's own validation seeds too, wherever they start
    yaml = tmp_path / "run.yaml"
    yaml.write_text(Path(COLD_START).read_text() + "\n" + "validation: {seed_start: 500}\n")
    config = ["--config", str(yaml)]
    assert main(["demos", *config, "--seeds", "490:510", "--out", str(out)]) == 2
    assert "[500, 532)" in capsys.readouterr().out and not out.exists()
    assert main(["demos", *config, "--seeds", "532:534", "--out", str(out)]) == 0
    assert {r["seed"] for r in read(out)} == {532, 533}


def test_a_config_gives_the_prompts_of_its_rollouts(tmp_path: Path) -> None:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.rollout.sources import env_factory

    out = tmp_path / "demos.jsonl"
    assert main(["demos", "--config", COLD_START, "--seeds", "0:3", "--out", str(out)]) == 0
    env = env_factory(load_config(COLD_START))()  # the env `masenvs train` builds
    for row in read(out):
        _, infos = env.reset(seed=row["seed"])
        if row["agent"] == "plan":
            env.step({"tool": solver_reply(env, "tool")})
            infos = {"plan": {"messages": env.messages("plan")}}
        assert row["messages"][:-1] == infos[row["agent"]]["messages"]


def test_demos_are_in_the_format_sft_reads(tmp_path: Path) -> None:
    from masenvs.engine.loading import load_tokenizer

    out = tmp_path / "demos.jsonl"
    assert main(["demos", "--config", COLD_START, "--seeds", "0:4", "--out", str(out)]) == 0
    conversations = read_traces([out])
    assert [c.agent for c in conversations] == ["tool", "plan"] * 4
    tokenizer = load_tokenizer("tiny")
    for c in conversations:
        found, cut = targets(c, tokenizer, {}, 4096)
        assert len(found) == 1 and cut == 0
        reply = tokenizer.decode(found[0].completion_token_ids, skip_special_tokens=True)
        assert reply.strip() == c.messages[-1]["content"]


@pytest.mark.parametrize("env_name", sorted(HINT_FREE))
def test_a_rollouts_prompts_hold_no_solver_output(env_name: str) -> None:
    """The solver's answer reaches no prompt: wrong answers get feedback, never the answer."""
    # no example answer in the prompt: a path that happens to be the example is no leak
    example = {"answer_example": False} if env_name == "plan_path" else {}
    env = make(env_name, **HINT_FREE[env_name], **example, max_rounds=3)
    for seed in range(8):
        env.reset(seed=seed)
        answers = [solver_reply(env, a).split("####")[-1].strip() for a in env.possible_agents]
        prompts = []
        while env.agents:
            prompts.append("\n".join(m["content"] for m in env.messages(env.acting)))
            env.step({env.acting: "#### [U]" if env_name != "sudoku" else "#### [[0, 0, 0]]"})
        leaked = [a for a in answers if any(leaks(a, p) for p in prompts)]
        assert not leaked, (seed, leaked)


def leaks(answer: str, prompt: str) -> bool:
    """The answer's content in the prompt: its move list or its rows of digits."""
    inner = answer.strip("[]")
    return len(inner) > 4 and (inner in prompt or answer.replace("\n", "") in prompt)


def test_the_leak_check_finds_a_hint_that_gives_the_answer() -> None:
    """The check above can fail: show_offset on an open grid states the shortest path."""
    env = make("plan_path", size=5, obstacle_ratio=0.0, show_offset=True, single_agent=True)
    found = 0
    for seed in range(8):
        env.reset(seed=seed)
        answer = solver_reply(env, "plan").split("####")[-1].strip()
        found += leaks(answer, "\n".join(m["content"] for m in env.messages("plan")))
    assert found >= 4


def test_episode_demos_stop_on_a_reply_the_env_rejects(monkeypatch) -> None:
    import masenvs.demos as module

    env = make("plan_path", size=4, single_agent=True)
    monkeypatch.setitem(module.SOLVERS, "plan_path", lambda env: "[U, U, U, U]")
    with pytest.raises(DemoError, match="did not accept"):
        episode_demos(env, 3)


DEMO_MODULES = {"masenvs.demos", "masenvs.demo_programs"}


def importers_of_demos(root: Path = ROOT) -> list[str]:
    """Every package module that imports masenvs.demos or masenvs.demo_programs."""
    import ast

    found = []
    for folder in ("masenvs", "adapters", "trainer"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                if DEMO_MODULES & set(names):
                    found.append(path.relative_to(root).as_posix())
                    break
    return found


def test_only_the_demos_command_calls_the_solvers_demonstrations() -> None:
    """No env, tool, policy or trainer part of a rollout imports the demonstrations' solvers."""
    assert importers_of_demos() == ["masenvs/demos.py", "trainer/commands/demos.py"]


def test_a_tool_program_cannot_import_the_solvers() -> None:
    """The sandbox a rollout's programs run in has no masenvs to import."""
    from masenvs.envs.tooling import run_tool

    program = "```python\nfrom masenvs.demos import shortest_path\nprint('Moves: [U]')\n```"
    run = run_tool(program, 5.0)
    assert not run.ok and "No module named 'masenvs'" in run.output


def test_wrong_proposals_show_the_plan_a_wrong_move_list_and_keep_its_right_answer(
    tmp_path: Path, capsys
) -> None:
    import re

    out, again = tmp_path / "demos.jsonl", tmp_path / "again.jsonl"
    args = ["demos", "--config", COLD_START, "--seeds", "200000:200040", "--explain"]
    assert main([*args, "--wrong-proposals", "0.5", "--out", str(out)]) == 0
    assert main([*args, "--wrong-proposals", "0.5", "--out", str(again)]) == 0
    assert out.read_text() == again.read_text()  # the seed picks the episodes and the lists
    lines = read(out)
    tool = {r["seed"]: r["messages"][-1]["content"] for r in lines if r["agent"] == "tool"}
    plan = [r for r in lines if r["agent"] == "plan"]
    # every episode keeps the tool's line, the solver's answer to its prompt (which the wrong
    # proposal played after it cannot change): a tool line per episode, as without the option
    assert len(plan) == 40 and sorted(tool) == list(range(200000, 200040))
    wrong = 0
    moves = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
    for row in plan:
        prompt, reply = row["messages"][-2]["content"], row["messages"][-1]["content"]
        board = [line.split()[1:] for line in prompt.split("\n") if re.match(r" \d ", line)]
        cell = {ch: (r, c) for r, line in enumerate(board) for c, ch in enumerate(line)}
        proposed = re.search(r"The tool agent proposes:\n#### \[(.*)\]", prompt)[1].split(", ")
        pos, seen = cell["A"], []
        for m in proposed:  # walked on the board the prompt shows: a wall or the edge stops it
            r, c = pos[0] + moves[m][0], pos[1] + moves[m][1]
            if 0 <= r < 4 and 0 <= c < 4 and board[r][c] != "#":
                pos = (r, c)
            seen.append(pos)
        # the plan reads the tool's (right) line, or a wrong list that never touches G ...
        written = tool[row["seed"]].split("#### ")[1]
        assert (cell["G"] in seen) == (f"[{', '.join(proposed)}]" == written), (prompt, reply)
        wrong += cell["G"] not in seen
        # ... and the plan answers from the board either way: the solver's worked answer
        assert reply.startswith(f"A is at row {cell['A'][0]}, column {cell['A'][1]}; G is at")
    assert 10 <= wrong <= 30  # about half the episodes
    # only where a plan agent reads a tool's proposal, and a share in [0, 1]
    capsys.readouterr()
    sudoku = ["demos", "sudoku", "--seeds", "0:2", "--out", str(tmp_path / "s")]
    assert main([*sudoku, "--wrong-proposals", "0.5"]) == 2
    assert "tool_task: propose" in capsys.readouterr().out
    assert main([*args, "--wrong-proposals", "1.5", "--out", str(out)]) == 2
    assert "between 0 and 1" in capsys.readouterr().out
