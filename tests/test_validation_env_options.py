"""`validation.env_options`: train on one task distribution (a curriculum of near goals) and
validate on another (every goal), in the real loop on the tiny model."""

from __future__ import annotations

import json
import re
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console
from tiny_runs import plan_path_run

import masenvs
from masenvs.trainer.config import ConfigError, load_config
from masenvs.trainer.run.train import train

WHERE = re.compile(r"A \(row (\d), column (\d)\); the goal G is at \(row (\d), column (\d)\)")


def _records(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "traces").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_training_draws_near_goals_and_validation_every_goal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "model.name=tiny",
        "steps=1",
        "env.options={size: 4, obstacle_ratio: 0.1, max_distance: 1}",
        "validation.every=1",
        "validation.episodes=8",
        "validation.env_options={max_distance: null}",
    ]
    train(load_config(None, plan_path_run(run_dir, *overrides)), console=Console(file=StringIO()))
    records = _records(run_dir)
    seed_of = {r["rollout_id"]: r["extra"]["seed"] for r in records if r["type"] == "episode"}
    seen: dict[str, set] = {"train": set(), "val": set()}
    for call in (r for r in records if r["type"] == "call" and r["call_index"] == 0):
        r0, c0, r1, c1 = map(int, WHERE.search(call["messages"][-1]["content"]).groups())
        kind = "val" if call["rollout_id"].startswith("val") else "train"
        seen[kind].add((call["rollout_id"], abs(r1 - r0) + abs(c1 - c0)))
        if kind == "val":  # the task the full distribution draws for that seed
            env = masenvs.make("plan_path", size=4, obstacle_ratio=0.1)
            env.reset(seed=seed_of[call["rollout_id"]])
            assert ((r0, c0), (r1, c1)) == (env.task.start, env.task.goal)
    assert seen["train"] and all(d == 1 for _, d in seen["train"])  # the curriculum
    assert len({rid for rid, _ in seen["val"]}) == 16  # 8 episodes at steps 0 and 1
    assert max(d for _, d in seen["val"]) > 1  # validation is not held to it


def test_a_bad_validation_option_fails_before_training(tmp_path: Path) -> None:
    overrides = [
        "model.name=tiny",
        "validation.every=1",
        "validation.env_options={max_distance: 0}",
    ]
    with pytest.raises(ConfigError, match="validation.env_options: .*max_distance"):
        train(load_config(None, plan_path_run(tmp_path / "run", *overrides)))
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step, no validation


def test_validation_options_are_checked_when_the_config_is_read(tmp_path: Path) -> None:
    # A typo or a bad value fails in load_config, before torch or a model is touched.
    base = plan_path_run(tmp_path / "run", "model.name=tiny")
    for bad, expected in (
        ("{max_distance: 0}", "validation.env_options: .*max_distance"),
        ("{max_distanse: 2}", "validation.env_options: .*max_distanse"),
    ):
        with pytest.raises(ConfigError, match=expected):
            load_config(None, [*base, f"validation.env_options={bad}"])
    with pytest.raises(ConfigError, match="distributed.rollout_workers validate with env.options"):
        load_config(
            None,
            [*base, "validation.env_options={max_distance: 2}", "distributed.rollout_workers=2"],
        )
    assert load_config(None, [*base, "validation.env_options={max_distance: 2}"])


def test_a_config_built_in_code_is_checked_by_the_same_rule(tmp_path: Path) -> None:
    cfg = load_config(None, plan_path_run(tmp_path / "run", "model.name=tiny"))
    cfg.validation.env_options = {"max_distance": 0}  # set after load_config checked it
    with pytest.raises(ConfigError, match="validation.env_options: .*max_distance"):
        train(cfg)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step, no validation


def test_eval_of_a_checkpoint_plays_the_task_its_run_validated_on(tmp_path: Path) -> None:
    from masenvs.trainer.commands.eval import main
    from masenvs.trainer.learner.learner import Learner
    from masenvs.trainer.run.checkpoint import TrainState, save_checkpoint

    overrides = [
        "model.name=tiny",
        "env.options={size: 4, obstacle_ratio: 0.1, max_distance: 1}",
        "validation.env_options={max_distance: null}",
    ]
    cfg = load_config(None, plan_path_run(tmp_path / "run", *overrides))
    learner = Learner(cfg, ["tool", "plan"])
    path = save_checkpoint(cfg.run_dir, learner, TrainState(step=1, next_task_seed=0), cfg)
    out = tmp_path / "eval.json"
    args = ["--checkpoint", str(path), "--tasks", "2", "-n", "1", "--max-tokens", "4"]
    assert main([*args, "--dtype", "float32", "--out", str(out)]) == 0
    options = json.loads(out.read_text())["env_options"]
    assert (
        options["max_distance"] is None and options["size"] == 4
    )  # the whole task, not training's
