"""Every first-hour mistake gets one clear line and a non-zero exit, quickly: each command
runs as a user runs it, in a subprocess, and no `--help` or config error loads torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

MASENVS = [sys.executable, "-m", "masenvs"]
QUICKSTART = Path(__file__).parents[1] / "examples" / "quickstart.yaml"


def run(*args: str, cwd: Path | None = None, timeout: float = 180) -> tuple[int, list[str]]:
    """Exit status and the non-empty lines of stdout + stderr, as a log would hold them."""
    env = {**os.environ, "COLUMNS": "400"}
    done = subprocess.run(
        [*MASENVS, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines


def one_line(args: list[str], *expected: str, code: int = 2, cwd: Path | None = None) -> str:
    status, lines = run(*args, cwd=cwd)
    assert status == code, lines
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in lines[0] and "errors.pydantic.dev" not in lines[0]
    return lines[0]


def test_a_misspelt_env_name_in_a_train_config(tmp_path: Path) -> None:
    one_line(
        ["train", str(QUICKSTART), "--set", "env.name=plan_pth", "--set", f"run_dir={tmp_path}"],
        "env.name: unknown environment 'plan_pth'; did you mean 'plan_path'?",
    )


def test_a_misspelt_env_option_in_a_train_config(tmp_path: Path) -> None:
    config = yaml.safe_load(QUICKSTART.read_text())
    config["env"]["options"]["sise"] = 4
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    one_line(
        ["train", str(path), "--set", f"run_dir={tmp_path / 'run'}"],
        "env.options: plan_path: unknown option 'sise' (did you mean 'size'?)",
    )
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_bad_env_option_value_in_a_train_config(tmp_path: Path) -> None:
    one_line(
        ["train", str(QUICKSTART), "--set", "env.options.size=-3", "--set", f"run_dir={tmp_path}"],
        "env.options: plan_path: option size=-3:",
    )


def test_a_misspelt_training_field() -> None:
    one_line(
        ["train", str(QUICKSTART), "--set", "rollout.branchs=4"],
        "rollout.branchs: unknown field (did you mean 'branches'?)",
    )


def test_play_with_a_wrong_option_or_env() -> None:
    one_line(["play", "sudoku", "--set", "sizee=4"], "sudoku: unknown option 'sizee'")
    one_line(["play", "sudoku", "--set", "size=5"], "sudoku: option size=5: Input should be")
    one_line(["play", "sudokuu"], "unknown environment 'sudokuu'; did you mean 'sudoku'?")


def test_rollout_with_a_wrong_env() -> None:
    one_line(["rollout", "--env", "sokobn"], "did you mean 'sokoban'?")
    one_line(["rollout", "--env", "sokoban", "--set", "widht=7"], "did you mean 'width'?")


def test_masenvs_make_gives_the_same_lines() -> None:
    import masenvs

    with pytest.raises(masenvs.EnvConfigError) as caught:
        masenvs.make("sudoku", sizee=4)
    assert str(caught.value) == "sudoku: unknown option 'sizee' (did you mean 'size'?)"
    with pytest.raises(KeyError) as missing:
        masenvs.make("sudokuu")
    assert str(missing.value).startswith("unknown environment 'sudokuu'; did you mean 'sudoku'?")


def test_a_script_that_never_shuts_its_engine_down_exits_cleanly() -> None:
    code = (
        "from masenvs.engine.engine import EmbeddedBackend\n"
        "engine = EmbeddedBackend.from_spec('tiny')\n"
        "print('done')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr


def test_python_dash_m_masenvs_works() -> None:
    status, lines = run("list")
    assert status == 0 and any("plan_path" in line for line in lines)


COMMANDS = ["", "list", "play", "rollout", "serve", "train", "eval", "demos", "mas-graph", "ui"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_cleanly_and_loads_no_torch(command: str) -> None:
    done = subprocess.run(
        [*MASENVS, *command.split(), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    # What makes help slow, checked directly rather than timed (a time limit's verdict would
    # rest on the CPU and its neighbours; bench/ measures speed): nothing heavy is imported
    # before the arguments are parsed.
    probe = (
        "import sys\nfrom masenvs.cli import main\n"
        f"try:\n    main({[*command.split(), '--help']!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'openai', 'transformers', 'langgraph') if m in sys.modules]\n"
        "print(heavy)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_a_config_error_loads_no_torch(tmp_path: Path) -> None:
    probe = (
        "import sys\nfrom masenvs.cli import main\n"
        f"code = main(['train', {str(QUICKSTART)!r}, '--set', 'env.name=nope'])\n"
        "print(code, [m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == "2 []", done.stdout
