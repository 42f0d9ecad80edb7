"""The test tiers (tests/tiers.py, docs/testing.md): every test module says what its tests
start, the README's run is the fast tier and says what it left out, and CI runs the rest."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tiers

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def test_every_test_module_says_what_its_tests_start() -> None:
    modules = {p.stem for p in TESTS.rglob("test_*.py")}
    unlisted = sorted(modules - set(tiers.MODULES))
    assert not unlisted, (
        f"{', '.join(unlisted)}: not in tests/tiers.py MODULES; add each with the marks of "
        f"what its tests start (one of {', '.join(tiers.STARTS)}, or none)"
    )
    gone = sorted(set(tiers.MODULES) - modules)
    assert not gone, f"{', '.join(gone)}: in tests/tiers.py MODULES but no such test module"


def test_every_single_test_named_in_the_tables_exists() -> None:
    names = {
        f"{path.stem}::{node.name}"
        for path in TESTS.rglob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    stale = sorted({*tiers.TESTS, *tiers.SLOW} - names)
    assert not stale, f"tests/tiers.py names tests that do not exist (renamed?): {stale}"


def test_every_mark_a_tier_uses_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    declared = set(re.findall(r'^\s*"(\w+): ', text, re.MULTILINE))
    used = {m for marks in [*tiers.MODULES.values(), *tiers.TESTS.values()] for m in marks}
    assert used <= set(tiers.STARTS) and {*tiers.STARTS, "fast"} <= declared


def test_the_fast_run_says_what_it_left_out(tmp_path: Path) -> None:
    # A module of its own, run with this conftest: one test of each kind.
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (tmp_path / "test_models.py").write_text(
        "def test_tiny_model_is_cached_deterministic_and_chat_ready():\n    pass\n"
        "def test_smollm2_answers_coherently():\n    pass\n"
    )
    (tmp_path / "test_ui.py").write_text("def test_a_page():\n    pass\n")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = subprocess.run(
        [*run, "-m", "fast", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 2 deselected" in done.stdout
    lines = done.stdout.split("left out of this run", 1)[1].splitlines()
    assert any(re.match(r"\s+1 slow\s+pytest -m slow$", line) for line in lines), lines
    assert any(re.match(r"\s+1 browser\s+pytest -m browser$", line) for line in lines), lines

    everything = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert "3 passed" in everything.stdout and "left out" not in everything.stdout


def test_ci_runs_the_fast_tier_then_the_rest_and_nothing_twice() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    runs = re.findall(r"pytest (.*?-m (\"[^\"]*\"|'[^']*'|\w+).*)$", ci, re.MULTILINE)
    selections = [m.strip("\"'") for _, m in runs]
    assert selections[0] == "fast", selections
    rest = [s for s in selections[1:] if s != "learning"]  # the AVX2 rerun repeats on purpose
    assert rest == [
        f"not fast and not ({' or '.join(tiers.PARALLEL_UNSAFE)})",
        f"not fast and ({' or '.join(tiers.PARALLEL_UNSAFE)})",
    ], rest
    parallel = next(line for line, m in runs if m.strip("\"'") == rest[0])
    assert "-n " in parallel
