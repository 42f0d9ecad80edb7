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
    for helper in ("tiers.py", "exclusive.py"):
        (tmp_path / helper).write_text((TESTS / helper).read_text())
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

    # Under xdist (the README's run) the workers collect; the controller says it at the end.
    xdist = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    done = subprocess.run(
        [*xdist, "-m", "fast", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split("left out of this run", 1)[1].splitlines()
    assert any(re.match(r"\s+1 slow\s+pytest -m slow$", line) for line in lines), lines

    everything = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert "3 passed" in everything.stdout and "left out" not in everything.stdout


def test_ci_runs_the_fast_tier_then_the_rest_and_nothing_twice() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    runs = re.findall(r"pytest (.*?-m (\"[^\"]*\"|'[^']*'|\w+).*)$", ci, re.MULTILINE)
    selections = [m.strip("\"'") for _, m in runs]
    assert selections[0] == "fast", selections
    rest = [s for s in selections[1:] if s != "learning"]  # the AVX2 rerun repeats on purpose
    assert rest == ["not fast"], rest
    for line, _ in runs:  # on every core; the PARALLEL_UNSAFE ones run alone even so
        assert "-n " in line, line


def test_a_serial_test_runs_alone_under_xdist(tmp_path: Path) -> None:
    """Two workers: while the serial test of one module runs, no test of the other does."""
    log = tmp_path / "log"
    conftest = (
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import pytest\nfrom exclusive import held\n\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_protocol(item):\n    with held(item):\n        yield\n"
    )
    (tmp_path / "conftest.py").write_text(conftest)
    # A test that runs pytest in a subprocess (which inherits the workers' PYTEST_XDIST_*
    # variables) while the serial test waits: the inner run must not wait on the lock.
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "conftest.py").write_text(conftest)
    (tmp_path / "inner" / "test_inner.py").write_text("def test_inner():\n    pass\n")
    nested = (
        "\nimport subprocess, sys\n\ndef test_nested():\n    time.sleep(0.5)\n"
        "    subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:xdist', "
        f"{str(tmp_path / 'inner')!r}], check=True, timeout=60)\n"
    )
    body = (
        "import time\n\n"
        "def spell(name, seconds):\n"
        "    start = time.monotonic()\n    time.sleep(seconds)\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(f'{name} {start} {time.monotonic()}\\n')\n"
    )
    others = "".join(f"\ndef test_other_{i}():\n    spell('other', 0.3)\n" for i in range(8))
    (tmp_path / "test_a.py").write_text(body + nested + others)
    (tmp_path / "test_b.py").write_text(
        body + "import pytest\n\n@pytest.mark.serial\ndef test_alone():\n    spell('alone', 1.0)\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: alone\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    done = subprocess.run(
        [*command, "--dist", "loadfile", "--ignore", str(tmp_path / "inner"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spells = [line.split() for line in log.read_text().splitlines()]
    (alone,) = [(float(a), float(b)) for name, a, b in spells if name == "alone"]
    others = [(float(a), float(b)) for name, a, b in spells if name == "other"]
    assert len(others) == 8
    assert all(end <= alone[0] or start >= alone[1] for start, end in others), (alone, others)
