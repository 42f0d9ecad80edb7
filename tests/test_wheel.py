"""The built wheel holds every source and data file of masenvs/, adapters/ and trainer/, each
under its import path, and nothing installs as a top-level `adapters` or `trainer`.

Packages are discovered (setup.py), not listed: a new subpackage or data file that the build
would leave out fails here, not on a user's machine after `pip install masenvs`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the repository -> where its files live in the wheel (pyproject's package-dir)
ROOTS = {"masenvs": "masenvs", "adapters": "masenvs/adapters", "trainer": "masenvs/trainer"}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")


def source_files() -> list[str]:
    """Files git tracks (or would track: new, not ignored) under the three package roots."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *ROOTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    # --cached still lists a file deleted in the work tree (a `git mv` not yet committed)
    return sorted(f for f in out if f and (ROOT / f).is_file())


def wheel_name(path: str) -> str:
    """Where the repository file `path` must be inside the wheel."""
    top, _, rest = path.partition("/")
    return f"{ROOTS[top]}/{rest}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """Build the wheel offline from a copy of the sources (the build writes build/ and
    *.egg-info next to the sources, which must not land in the working tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in [*source_files(), *BUILD_FILES]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    # no build isolation: the venv's setuptools (dev extra) builds it, with no index to reach
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "-q", "-w", str(tmp / "dist"), str(src)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"the wheel did not build:\n{done.stdout}\n{done.stderr}"
    (whl,) = (tmp / "dist").glob("masenvs-*.whl")
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(tmp / "unpacked")
        return zf.namelist(), tmp / "unpacked"


def test_every_source_and_data_file_is_in_the_wheel(wheel: tuple[list[str], Path]) -> None:
    names, _ = wheel
    files = source_files()
    assert any(f.endswith(".c") for f in files) and any(f.endswith(".json") for f in files)
    missing = [f"{f} (expected as {wheel_name(f)})" for f in files if wheel_name(f) not in names]
    assert not missing, (
        "the wheel leaves out these files; a folder of .py files needs an __init__.py, a data "
        "file a [tool.setuptools.package-data] glob in pyproject.toml:\n  " + "\n  ".join(missing)
    )


def test_the_wheel_holds_no_python_file_that_is_not_in_the_sources(
    wheel: tuple[list[str], Path],
) -> None:
    names, _ = wheel
    expected = {wheel_name(f) for f in source_files()}
    extra = [n for n in names if n.endswith(".py") and n not in expected]
    assert not extra, f"stale or misplaced modules in the wheel: {extra}"


def test_adapters_and_trainer_install_only_under_masenvs(wheel: tuple[list[str], Path]) -> None:
    names, unpacked = wheel
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"masenvs", "masenvs-0.1.0.dist-info"}, tops
    (top_level,) = unpacked.glob("masenvs-*.dist-info/top_level.txt")
    # masenvs, and the module verifiers imports for the id `masenvs-verifiers`
    assert sorted(top_level.read_text().split()) == ["masenvs", "masenvs_verifiers"]
    (entry_points,) = unpacked.glob("masenvs-*.dist-info/entry_points.txt")
    assert "masenvs = masenvs.cli:main" in entry_points.read_text()


def test_the_unpacked_wheel_imports_and_finds_its_data(wheel: tuple[list[str], Path]) -> None:
    """Imported from the wheel, not from the editable checkout: the remapped subpackages
    resolve and the package data is where the code looks for it."""
    _, unpacked = wheel
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import masenvs, masenvs.adapters, masenvs.trainer, masenvs.ui.server\n"
        "from masenvs.tasks.verilog_problems import builtin_tasks\n"
        "from pathlib import Path\n"
        "for m in (masenvs, masenvs.adapters, masenvs.trainer):\n"
        "    assert Path(m.__file__).is_relative_to(sys.argv[1]), m.__file__\n"
        "ui = Path(masenvs.ui.server.__file__).parent\n"
        "assert (ui / 'templates' / 'base.html').is_file() and (ui / 'static' / 'app.js').is_file()\n"
        "print(len(builtin_tasks()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(unpacked)],
        capture_output=True,
        text=True,
        cwd=unpacked,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 0
