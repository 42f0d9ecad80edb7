"""A run sees what the interpreter and its allowed packages need, and nothing else of `/usr`;
where a copy of masenvs' task data is visible anyway, the judges refuse to score."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from masenvs.sandbox import Sandbox, SandboxError, SandboxLimits, layout

FAST = SandboxLimits(cpu_seconds=5.0, wall_seconds=10.0, memory_mb=256)
READ = "import sys\ntry:\n    print(open(sys.argv[1]).read())\nexcept OSError as exc:\n    print('unseen', exc.errno)\n"


@pytest.fixture
def checkout_under_usr() -> Path:
    """A masenvs checkout (hidden tests, .git) where a system-wide install would put it."""
    base = Path("/usr/src")
    if not os.access(base, os.W_OK):
        pytest.skip("/usr/src is not writable here (run as root)")
    root = base / f"masenvs-probe-{uuid.uuid4().hex[:8]}"
    (root / "masenvs" / "tasks" / "data").mkdir(parents=True)
    (root / "masenvs" / "tasks" / "data" / "hidden.json").write_text('{"expected": "SECRET-1"}')
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    try:
        yield root
    finally:
        shutil.rmtree(root)


def test_a_checkout_under_usr_is_not_in_a_run(checkout_under_usr: Path) -> None:
    with Sandbox(FAST) as sb:
        if not sb.isolation.allow_list:
            pytest.skip("no allow-list root on this machine")
        for path in ("masenvs/tasks/data/hidden.json", ".git/HEAD"):
            res = sb.run(READ, args=[str(checkout_under_usr / path)])
            assert res.ok, res.stderr
            assert res.stdout.startswith("unseen"), (path, res.stdout)
        sb.check_judging()


def test_a_run_does_not_see_all_of_usr() -> None:
    with Sandbox(FAST) as sb:
        if not sb.isolation.allow_list:
            pytest.skip("no allow-list root on this machine")
        probe = "import os\nprint(sorted(os.listdir('/usr/share')) if os.path.isdir('/usr/share') else [])"
        res = sb.run(probe)
        assert res.ok, res.stderr
        assert "doc" not in res.stdout and "perl" not in res.stdout, res.stdout
        # What programs use still works: the stdlib, its C modules, the allowed packages.
        use = "import decimal, sqlite3, ssl, numpy, sympy\nprint(sympy.factorint(int(numpy.int64(60))))"
        res = sb.run(use)
        assert res.ok and res.stdout.strip() == "{2: 2, 3: 1, 5: 1}", res.stderr


@pytest.fixture
def vendored_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An allowed package that vendors a copy of masenvs, tasks included."""
    site = tmp_path / "site-packages"
    pkg = site / "vendorpkg"
    (pkg / "_vendor" / "masenvs" / "tasks" / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_vendor" / "masenvs" / "tasks" / "data" / "hidden.json").write_text("SECRET-2")
    info = site / "vendorpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vendorpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("vendorpkg/__init__.py,,\nvendorpkg-1.0.dist-info/METADATA,,\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.syspath_prepend(str(site))
    layout._top_level_distributions.cache_clear()
    layout._distribution_paths.cache_clear()
    return str(pkg / "_vendor" / "masenvs" / "tasks" / "data" / "hidden.json")


def test_judges_refuse_when_task_data_of_a_masenvs_copy_is_visible(
    vendored_copy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MASENVS_ALLOW_WEAK_SANDBOX", raising=False)
    with Sandbox(FAST, packages=("vendorpkg",)) as sb:
        if not sb.isolation.allow_list:
            pytest.skip("no allow-list root on this machine")
        with pytest.raises(SandboxError, match="masenvs"):
            sb.check_judging()
        assert not sb.isolation.judging_safe
