"""A run that cannot learn says so: one warning per reason a step cannot move the weights
(no sample, every group flat, a learning rate ~0, a zero gradient), the update's figures on
the progress line, and at the end how far each adapter moved."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from rich.console import Console
from tiny_runs import plan_path_run

from masenvs.trainer.config import load_config
from masenvs.trainer.run.metrics import moves_line, schedule_warning, step_warnings

UPDATE = {
    "groups/groups": 4.0,
    "groups/zero_std": 1.0,
    "learner/lr": 1e-5,
    "learner/solver/loss": -0.02,
    "learner/solver/grad_norm": 0.3,
}


def test_a_warmup_as_long_as_the_run_is_named_with_the_fix() -> None:
    cfg = load_config(None, ["steps=2"])  # the default warmup_steps is 10
    warning = schedule_warning(cfg)
    assert warning is not None
    assert "optim.warmup_steps=10 is longer than the run (steps=2)" in warning
    assert "below 20% of optim.lr=1e-05" in warning and "--set optim.warmup_steps=0" in warning
    assert schedule_warning(load_config(None, ["steps=100"])) is None
    assert schedule_warning(load_config(None, ["steps=10"])) is None  # the last step reaches lr
    assert schedule_warning(load_config(None, ["steps=2", "optim.warmup_steps=0"])) is None


def test_a_step_that_learns_gives_no_warning() -> None:
    cfg = load_config(None, ["steps=100"])
    assert step_warnings(3, UPDATE, cfg, trained=True) == []


def test_all_groups_flat_is_a_warning() -> None:
    cfg = load_config(None, ["steps=100"])
    (warning,) = step_warnings(3, {**UPDATE, "groups/zero_std": 4.0}, cfg, trained=True)
    assert warning.startswith("step 3: all 4 groups had equal rewards")
    assert "rollout.branches" in warning


def test_a_learning_rate_near_zero_is_a_warning() -> None:
    cfg = load_config(None, ["steps=100", "optim.warmup_steps=500"])
    (warning,) = step_warnings(1, {**UPDATE, "learner/lr": 2e-8}, cfg, trained=True)
    assert "the learning rate is 2e-08, under 1% of optim.lr=1e-05" in warning
    assert "optim.warmup_steps=500" in warning


def test_a_zero_gradient_is_a_warning_per_policy() -> None:
    cfg = load_config(None, ["steps=100"])
    row = {**UPDATE, "learner/solver/grad_norm": 0.0, "learner/checker/grad_norm": 0.5}
    (warning,) = step_warnings(2, row, cfg, trained=True)
    assert warning.startswith("step 2: policy solver's gradient is 0")


def test_moves_line_names_each_adapter() -> None:
    line = moves_line({"solver": (0.0123, 0.0041), "checker": (0.0, 0.0)})
    assert "solver 0.0123 (0.41% of its start)" in line and "checker 0 (unchanged)" in line


def test_the_two_step_default_run_prints_the_warmup_warning_and_its_figures(
    tmp_path: Path,
) -> None:
    from masenvs.trainer.run.train import train

    cfg = load_config(None, [*plan_path_run(tmp_path / "run"), "model.name=tiny"])
    printed = StringIO()
    train(cfg, console=Console(file=printed, width=400))
    out = printed.getvalue()
    assert "warning: optim.warmup_steps=10 is longer than the run (steps=2)" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps if "success" in s] == ["1/2", "2/2"]
    for line in steps:
        if "success" in line:
            assert " lr " in line and " loss " in line and " gnorm " in line, line
            assert " |dlogp| " in line, line
    (moved,) = [line for line in out.splitlines() if line.startswith("adapters moved")]
    assert "tool" in moved and "plan" in moved, moved


def test_a_step_with_no_sample_says_why(tmp_path: Path) -> None:
    from masenvs.trainer.run.train import train

    cfg = load_config(
        None,
        [
            *plan_path_run(tmp_path / "run"),
            "model.name=tiny",
            "steps=1",
            "agents.tool.freeze=true",  # every sample a frozen agent's: nothing to train
            "agents.plan.freeze=true",
        ],
    )
    printed = StringIO()
    train(cfg, console=Console(file=printed, width=400))
    out = printed.getvalue()
    assert "warning: step 1/1: no trainable sample, no update: every sample is a frozen" in out
    assert "no update" in out.split("step 1/1  success")[1]  # on the progress line too


def test_failed_validation_episodes_are_counted_logged_and_warned(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    # Issue 33: under load, 29 of 32 validation episodes timed out and the run printed
    # "success 0%" with no word of why. They still count as failures, but the run says so.
    from masenvs.adapters.episodes import EpisodeResult
    from masenvs.trainer.rollout import sources
    from masenvs.trainer.run.metrics import validation_warning
    from masenvs.trainer.run.train import train

    def result(seed: int, error: str | None) -> EpisodeResult:
        return EpisodeResult(
            "val0-x", "plan_path", seed, error is None, 1, {"plan": 1.0}, 5, 0.1, error
        )

    results = [result(1, None), result(2, "APITimeoutError: Request timed out."), result(3, None)]
    metrics = sources.validation_metrics(results)
    assert metrics["val/errors"] == 1.0 and metrics["val/episodes"] == 3.0
    assert metrics["val/success"] == 2 / 3
    assert "plan_path:2 failed: APITimeoutError" in caplog.text
    warning = validation_warning(4, metrics)
    assert warning is not None and "1 of 3 validation episodes failed" in warning
    assert "lower bound" in warning
    assert validation_warning(4, {"val/success": 1.0, "val/errors": 0.0}) is None

    async def failing_validate(self, step: int, progress: object = None) -> dict[str, float]:
        return sources.validation_metrics([result(7, "APITimeoutError: Request timed out.")])

    monkeypatch.setattr(sources.TreeSource, "validate", failing_validate)
    overrides = ["model.name=tiny", "steps=1", "validation.every=1", "validation.episodes=1"]
    cfg = load_config(None, [*plan_path_run(tmp_path / "run"), *overrides])
    printed = StringIO()
    train(cfg, console=Console(file=printed, width=400))
    out = printed.getvalue()
    assert "warning: step 0: 1 of 1 validation episodes failed" in out
    assert "warning: step 1: 1 of 1 validation episodes failed" in out
