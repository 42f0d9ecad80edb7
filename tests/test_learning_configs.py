"""The configs docs/learning.md runs: each loads, and its env plays one scripted turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from masenvs.trainer.config import load_config
from masenvs.trainer.rollout.sources import env_factory

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    ROOT / "examples" / "quickstart.yaml",
    *sorted((ROOT / "examples" / "learning").glob("*.yaml")),
]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_learning_config_builds_its_env(path: Path) -> None:
    cfg = load_config(path)
    assert set(cfg.validation_seeds()).isdisjoint(cfg.train_seeds())
    assert cfg.validation.episodes >= 32 and cfg.validation.temperature == 0.0
    env = env_factory(cfg)()
    _, infos = env.reset(seed=cfg.validation.seed_start)
    agent = env.acting
    _, rewards, _, _, _ = env.step({agent: "no answer"})
    assert rewards[agent] < 0  # an unparsable answer is penalised, not an error


def test_quickstart_tool_proposes_and_sees_the_straight_moves() -> None:
    env = env_factory(load_config(ROOT / "examples" / "quickstart.yaml"))()
    _, infos = env.reset(seed=0)
    prompt = infos["tool"]["messages"][-1]["content"]
    assert "if no wall is in the way" in prompt and "####" in prompt
