"""The `--set` overrides of a short training run on the tiny model, shared by the trainer tests.

Two steps of plan-path on 4x4 grids, K=2, two tasks a step, one round, eight tokens a turn,
no validation, float32 weights: small enough to train in seconds, large enough that every
step has groups to learn from. Tests add what they exercise (`*overrides` come last and win).
"""

from __future__ import annotations

from pathlib import Path

PLAN_PATH_2_STEPS = (
    "steps=2",
    "env.name=plan_path",
    "env.options={size: 4}",
    "rollout.branches=2",
    "rollout.tasks_per_step=2",
    "rollout.max_rounds=1",
    "rollout.max_tokens=8",
    "validation.every=0",
    "logging.tensorboard=false",
    "backend.dtype=float32",
    "backend.max_batch_size=8",
)


def plan_path_run(run_dir: Path, *overrides: str) -> list[str]:
    """Overrides for a 2-step plan-path run writing to `run_dir`, then `overrides`."""
    return [f"run_dir={run_dir}", *PLAN_PATH_2_STEPS, *overrides]
