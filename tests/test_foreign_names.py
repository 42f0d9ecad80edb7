"""A name a user brings from TRL or verl gets our key in the unknown-field error, one line,
whether it came through `--set` or a YAML file; a name with no counterpart says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from masenvs.trainer.config import ConfigError, TrainConfig, load_config
from masenvs.trainer.foreign_names import NAMES

QUICKSTART = Path(__file__).parents[1] / "examples" / "quickstart.yaml"


def error_of(path: Path | None = None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "optim.learning_rate=1e-5",
            "optim.learning_rate: unknown field (did you mean 'optim.lr'? TRL's learning_rate)",
        ),
        ("learning_rate=1e-5", "did you mean 'optim.lr'? TRL's learning_rate"),
        ("rollout.num_generations=8", "did you mean 'rollout.branches'? TRL's num_generations"),
        ("max_completion_length=256", "did you mean 'rollout.max_tokens'?"),
        ("algorithm.beta=0.04", "did you mean 'algorithm.kl_coef'? TRL's beta"),
        ("epsilon_high=0.28", "did you mean 'algorithm.clip_high'? TRL's epsilon_high"),
        ("max_grad_norm=1.0", "did you mean 'optim.grad_clip'?"),
        ("max_steps=50", "did you mean 'steps'? TRL's max_steps"),
        ("rollout.n=8", "did you mean 'rollout.branches'? verl's actor_rollout_ref.rollout.n"),
        ("per_device_train_batch_size=4", "masenvs has no TRL per_device_train_batch_size"),
        ("loss_type=dapo", "masenvs has no TRL loss_type"),
    ],
)
def test_a_name_from_trl_or_verl_via_set(override: str, expected: str) -> None:
    message = error_of(None, [override])
    assert expected in message
    assert "\n" not in message


def test_a_verl_section_in_yaml_names_each_key(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "actor_rollout_ref:\n"
        "  actor:\n    optim: {lr: 1.0e-6}\n    ppo_mini_batch_size: 16\n"
        "    kl_loss_coef: 0.001\n"
        "  rollout: {n: 8}\n"
    )
    message = error_of(path)
    assert message.startswith(f"invalid config ({path}): actor_rollout_ref: unknown field")
    assert "\n" not in message
    for key, ours in [
        ("actor_rollout_ref.actor.optim.lr", "optim.lr"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "algorithm.mini_batch_size"),
        ("actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_coef"),
        ("actor_rollout_ref.rollout.n", "rollout.branches"),
    ]:
        assert f"{key} is '{ours}'" in message


def test_trl_names_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  learning_rate: 1.0e-6\n  warmup_ratio: 0.1\n")
    message = error_of(path)
    assert (
        "optim.learning_rate: unknown field (did you mean 'optim.lr'? TRL's learning_rate)"
        in message
    )
    assert "optim.warmup_ratio: unknown field (masenvs has no TRL warmup_ratio" in message
    assert "optim.warmup_steps" in message  # what to use instead


def test_a_misspelling_still_gets_the_close_name() -> None:
    assert "(did you mean 'clip_low'?)" in error_of(None, ["algorithm.clip_lwo=0.1"])


def test_every_counterpart_is_a_real_key() -> None:
    for foreign, name in NAMES.items():
        if name.ours is None:
            assert name.note, f"{foreign}: say what to use instead"
            continue
        section = TrainConfig
        *sections, leaf = name.ours.split(".")
        for part in sections:
            section = section.model_fields[part].annotation
        assert leaf in section.model_fields, f"{foreign} -> {name.ours}"


def test_the_cli_says_it_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "masenvs",
            "train",
            str(QUICKSTART),
            "--set",
            "optim.learning_rate=1e-5",
            "--set",
            f"run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "400"},  # as tests/test_cli_errors.py: no wrapping
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines
    assert "did you mean 'optim.lr'? TRL's learning_rate" in lines[0]


def test_docs_list_every_name() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = docs.split("### Coming from TRL or verl", 1)[1].split("\n## ", 1)[0]
    for foreign, name in NAMES.items():
        assert f"`{foreign}`" in section, foreign
        assert name.ours is None or f"`{name.ours}`" in section, name.ours
