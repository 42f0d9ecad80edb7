"""The engine package's front door: `from masenvs.engine import EmbeddedBackend, load_model`
gives the objects of their modules, and importing the package alone loads no torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_package_exports_its_front_door_without_warnings() -> None:
    code = (
        "from masenvs.engine import EmbeddedBackend, load_model\n"
        "import masenvs.engine.scheduler, masenvs.engine.kernels, masenvs.adapters.endpoint\n"
        "assert EmbeddedBackend.__module__ == 'masenvs.engine.engine'\n"
        "assert load_model.__module__ == 'masenvs.engine.loading'\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_package_imports_no_torch() -> None:
    code = "import sys, masenvs.engine\nassert 'torch' not in sys.modules, 'torch imported'\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
