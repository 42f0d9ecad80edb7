"""The README's set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, re.DOTALL)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "masenvs train examples/quickstart.yaml" in commands[0]
    assert "pytest" in commands[1]
    assert (ROOT / "examples" / "quickstart.yaml").is_file()


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci


def test_checkpoints_the_readme_serves_exist_after_the_quickstart() -> None:
    from masenvs.trainer.config import load_config

    cfg = load_config(ROOT / "examples" / "quickstart.yaml")
    text = (ROOT / "README.md").read_text()
    named = {int(step) for step in re.findall(r"runs/quickstart/checkpoints/step_(\d+)", text)}
    written = set(range(cfg.checkpoint.every, cfg.steps + 1, cfg.checkpoint.every)) | {cfg.steps}
    assert named and named <= written, (named, written)


def test_the_main_jobs_figures_say_which_kernels_gave_them() -> None:
    """Greedy validation reads differently on another kernel set (sums in another order):
    the paragraph with the README's figures names its set and what another CPU read."""
    text = (ROOT / "README.md").read_text()
    figures = next(p for p in text.split("\n\n") if "goes from 16% to" in p)
    assert "the AVX2 set" in figures and "MASENVS_CPU_KERNELS=avx2" in figures
    assert "AVX-512" in figures and "12.5% at step 0" in figures and "68.8%" in figures
    assert "docs/integrations.md" in figures and "docs/learning.md" in figures
