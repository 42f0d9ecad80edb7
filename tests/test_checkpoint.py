"""Checkpoints: exact round trip, atomic writes (crash and kill mid-write), exact resume."""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from masenvs.engine.loading import load_model
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.run import checkpoint as ckpt
from masenvs.trainer.run.checkpoint import (
    TrainState,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from masenvs.trainer.samples import Sample, tree_group

AGENTS = ["coder", "tester"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny").model


@pytest.fixture
def loader(tiny: Any) -> Any:
    return lambda name, device, dtype: copy.deepcopy(tiny).to(device=device, dtype=dtype)


def config(run_dir: Path, *overrides: str) -> TrainConfig:
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            "model.name=tiny",
            "steps=4",
            "lora.rank=4",
            "lora.dropout=0.1",  # train-mode forward draws from torch's RNG
            "algorithm.mini_batches=2",  # shuffles and takes two optimizer steps
            "optim.warmup_steps=1",
            "optim.lr=1e-2",
            *overrides,
        ],
    )


def batch(step: int, cfg: TrainConfig) -> list[Sample]:
    """The data of training step `step` (a pure function of the data position)."""
    rng = random.Random(step)
    samples = []
    for agent in AGENTS:
        for _ in range(4):
            prompt = [rng.randrange(49152) for _ in range(rng.randint(3, 20))]
            completion = [rng.randrange(49152) for _ in range(rng.randint(2, 12))]
            group = tree_group(step, 0, agent)
            samples.append(Sample(prompt, completion, [], agent, agent, group, rng.random()))
    return group_advantages(samples, cfg.algorithm)[0]


def adapters(learner: Learner) -> dict[str, torch.Tensor]:
    return {
        f"{p}/{k}": v for p in learner.policies for k, v in learner.adapter_state_dict(p).items()
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_restores_weights_optimizer_schedule_and_rng(
    tmp_path: Path, loader: Any
) -> None:
    cfg = config(tmp_path)
    learner = Learner(cfg, AGENTS, loader)
    learner.step(batch(0, cfg))
    path = save_checkpoint(tmp_path, learner, TrainState(step=1, next_task_seed=8), cfg)
    after_save = (random.random(), np.random.rand(), torch.rand(3))

    other = Learner(config(tmp_path, "seed=7"), AGENTS, loader)  # different init
    random.seed(1)  # scramble every generator: restore must put them back
    np.random.seed(1)
    torch.manual_seed(1)
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.path == path
    state = loaded.restore(other)

    assert state == TrainState(step=1, next_task_seed=8)
    assert_same(adapters(other), adapters(learner))
    assert other.steps_done == learner.steps_done == 1
    for name in AGENTS:
        mine = learner.policies[name].optimizer.state_dict()["state"]
        theirs = other.policies[name].optimizer.state_dict()["state"]
        assert mine.keys() == theirs.keys() and mine
        for i in mine:
            for k in mine[i]:
                assert torch.equal(mine[i][k], theirs[i][k])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[:2] == after_save[:2] and torch.equal(again[2], after_save[2])
    assert loaded.config() == cfg
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path: Path, loader: Any) -> None:
    cfg = config(tmp_path / "straight")
    torch.manual_seed(0)
    straight = Learner(cfg, AGENTS, loader)
    for step in range(4):
        straight.step(batch(step, cfg))

    cfg = config(tmp_path / "resumed")
    torch.manual_seed(0)
    first = Learner(cfg, AGENTS, loader)
    for step in range(2):
        first.step(batch(step, cfg))
    save_checkpoint(cfg.run_dir, first, TrainState(step=2, next_task_seed=2), cfg)
    del first

    def resume() -> Learner:
        torch.manual_seed(12345)  # a new process: whatever RNG state it starts with
        learner = Learner(cfg, AGENTS, loader)
        loaded = load_latest(cfg.run_dir)
        assert loaded is not None
        state = loaded.restore(learner)
        for step in range(state.step, 4):
            learner.step(batch(step, cfg))
        return learner

    assert_same(adapters(resume()), adapters(straight))

    # The check can fail: without the saved RNG, dropout masks differ and so do the weights.
    learner = Learner(cfg, AGENTS, loader)
    loaded = load_latest(cfg.run_dir)
    assert loaded is not None
    for policy in learner.policies:
        learner.load_adapter(policy, loaded.path / "adapters" / policy)
    learner.load_state_dict(torch.load(loaded.path / "learner.pt", weights_only=True))
    torch.manual_seed(12345)
    for step in range(2, 4):
        learner.step(batch(step, cfg))
    assert adapters(learner).keys() == adapters(straight).keys()
    assert any(not torch.equal(v, adapters(straight)[k]) for k, v in adapters(learner).items())


def test_a_failure_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, loader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path)
    learner = Learner(cfg, AGENTS, loader)
    learner.step(batch(0, cfg))
    first = save_checkpoint(tmp_path, learner, TrainState(step=1, next_task_seed=8), cfg)
    saved = adapters(learner)
    learner.step(batch(1, cfg))

    real_save = Learner.save_adapter

    def failing_save(self: Learner, policy: str, directory: Any) -> Path:
        if policy == "tester":  # the coder adapter is already written when this fails
            raise OSError("disk full")
        return real_save(self, policy, directory)

    monkeypatch.setattr(Learner, "save_adapter", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, learner, TrainState(step=2, next_task_seed=16), cfg)

    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", first.name]  # no debris
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state.step == 1
    fresh = Learner(cfg, AGENTS, loader)
    loaded.restore(fresh)
    assert_same(adapters(fresh), saved)


KILLED_WRITER = textwrap.dedent(
    """
    import copy, os, signal, sys
    from safetensors.torch import save_file
    from masenvs.engine.loading import load_model
    from masenvs.trainer.run import checkpoint as ckpt
    from masenvs.trainer.config import load_config
    from masenvs.trainer.learner.learner import Learner
    sys.path.insert(0, {tests!r})
    from test_checkpoint import AGENTS, adapters, batch, config

    run_dir = {run_dir!r}
    cfg = config(run_dir)
    tiny = load_model("tiny").model
    learner = Learner(cfg, AGENTS, lambda n, d, t: copy.deepcopy(tiny))
    learner.step(batch(0, cfg))
    ckpt.save_checkpoint(run_dir, learner, ckpt.TrainState(1, 8), cfg)
    save_file(adapters(learner), os.path.join(run_dir, "expected.safetensors"))
    learner.step(batch(1, cfg))

    calls = 0
    real_fsync = ckpt._fsync
    def dying_fsync(path):
        global calls
        calls += 1
        if calls == 3:  # some files of step 2 are on disk, the rest are not
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(path)
    ckpt._fsync = dying_fsync
    ckpt.save_checkpoint(run_dir, learner, ckpt.TrainState(2, 16), cfg)
    print("not killed")
    """
)


def test_a_process_killed_mid_write_resumes_from_the_previous_checkpoint(
    tmp_path: Path, loader: Any
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER.format(tests=str(REPO / "tests"), run_dir=str(tmp_path)))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr

    root = tmp_path / "checkpoints"
    assert any(p.name.startswith(".tmp-step_00000002") for p in root.iterdir())  # torn write
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state.step == 1
    cfg = config(tmp_path)
    learner = Learner(cfg, AGENTS, loader)
    loaded.restore(learner)
    assert_same(adapters(learner), load_file(str(tmp_path / "expected.safetensors")))

    # The resumed run saves its next checkpoint and clears the debris.
    learner.step(batch(1, cfg))
    save_checkpoint(tmp_path, learner, TrainState(step=2, next_task_seed=16), cfg)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


def test_keep_last_and_a_lagging_pointer(tmp_path: Path, loader: Any) -> None:
    cfg = config(tmp_path)
    learner = Learner(cfg, AGENTS, loader)
    for step in range(1, 6):
        save_checkpoint(tmp_path, learner, TrainState(step, step * 8), cfg, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000005"

    # A crash between the directory rename and the pointer update: the pointer lags.
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state.step == 5


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    assert list_checkpoints(tmp_path / "missing") == []


def test_fsync_really_runs_on_every_file(tmp_path: Path, loader: Any, monkeypatch: Any) -> None:
    seen: list[str] = []
    real = ckpt._fsync
    monkeypatch.setattr(ckpt, "_fsync", lambda p: (seen.append(os.path.basename(p)), real(p)))
    learner = Learner(config(tmp_path), AGENTS, loader)
    save_checkpoint(tmp_path, learner, TrainState(1, 8))
    for name in ("adapter_model.safetensors", "adapter_config.json", "learner.pt", "rng.pt"):
        assert name in seen
    assert "state.json" in seen and "checkpoints" in seen


# -- full fine-tuning ---------------------------------------------------------------------------


def full_weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {
        f"{p}/{k}": v
        for p in learner.policies
        if learner.trains(p)
        for k, v in learner.full_state_dict(p).items()
    }


def test_full_finetuning_resumes_exactly_and_saves_servable_models(
    tmp_path: Path, loader: Any
) -> None:
    overrides = ("policy.finetune=full", "optim.lr=1e-3", "agents.tester.freeze=true")
    cfg = config(tmp_path / "straight", *overrides)
    torch.manual_seed(0)
    straight = Learner(cfg, AGENTS, loader)
    for step in range(3):
        straight.step(batch(step, cfg))

    cfg = config(tmp_path / "resumed", *overrides)
    torch.manual_seed(0)
    first = Learner(cfg, AGENTS, loader)
    first.step(batch(0, cfg))
    path = save_checkpoint(cfg.run_dir, first, TrainState(step=1, next_task_seed=1), cfg)
    # A trained policy's directory is a model directory load_model (and vLLM) accept; a
    # frozen one is the base model and is not written.
    assert sorted(p.name for p in (path / "models").iterdir()) == ["coder"]
    served = load_model(str(path / "models" / "coder")).model
    saved = first.full_state_dict("coder")
    assert all(torch.equal(v, saved[k]) for k, v in served.state_dict().items() if k in saved)
    assert not (path / "adapters").exists()
    del first

    torch.manual_seed(12345)
    learner = Learner(cfg, AGENTS, loader)
    loaded = load_latest(cfg.run_dir)
    assert loaded is not None
    state = loaded.restore(learner)
    for step in range(state.step, 3):
        learner.step(batch(step, cfg))
    assert_same(full_weights(learner), full_weights(straight))
    # The optimizer state came back too: without it Adam's moments restart and weights differ.
    fresh = Learner(cfg, AGENTS, loader)
    fresh.load_model("coder", path / "models" / "coder")
    for step in range(1, 3):
        fresh.step(batch(step, cfg))
    assert any(
        not torch.equal(v, full_weights(straight)[k]) for k, v in full_weights(fresh).items()
    )
