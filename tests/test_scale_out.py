"""Everything of `distributed:` at once, as issue #17 asks to show on CPU: a local Ray cluster
on loopback with 2 rollout workers, 2 embedded engine servers behind the router, and a learner
of world size 2 on gloo; then the sharded checkpoint resumes the run on one learner process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from rich.console import Console

from masenvs.traces import TraceStore
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.run.checkpoint import SHARDED, load_latest
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
    )
    yield
    ray.shutdown()


def config(run: Path, *overrides: str) -> TrainConfig:
    return load_config(
        None,
        [
            f"run_dir={run}",
            "model.name=tiny",
            "env.name=plan_path",
            "env.options={size: 4}",
            "rollout.branches=2",
            "rollout.tasks_per_step=4",
            "rollout.max_rounds=1",
            "rollout.max_tokens=8",
            "validation.every=0",
            "checkpoint.every=1",
            "logging.tensorboard=false",
            "lora.rank=4",
            "backend.dtype=float32",
            "backend.max_batch_size=8",
            *overrides,
        ],
    )


def test_workers_engines_and_learner_ranks_train_together_and_resume_on_one_rank(
    cluster: None, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    scaled = (
        "distributed.ray_address=auto",  # the fixture's cluster: workers reach the endpoint by IP
        "distributed.rollout_workers=2",
        "distributed.engines.count=2",
        "distributed.learner.world_size=2",
        "distributed.learner.sharding=fsdp",
    )
    train(config(run, "steps=2", *scaled), console=Console(quiet=True))

    rows = [r for r in read_metrics(run / "metrics.jsonl") if "learner/lr" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/dropped_tasks"] == 0 and r["workers/restarts"] == 0 for r in rows)
    trained = [v for r in rows for k, v in r.items() if k.endswith("/tokens")]
    assert trained and all(v > 0 for v in trained), rows  # the ranks trained on samples

    # Both engines served calls and took both updates; no rollout mixed policy versions.
    report = json.loads((run / "engines.json").read_text())
    assert report["version"] == 2
    assert all(e["served"] > 0 for e in report["engines"].values()), report
    versions: dict[str, set[int]] = {}
    for call in TraceStore(run / "traces").calls():
        versions.setdefault(call.rollout_id, set()).add(call.policy_version)
    assert all(len(v) == 1 for v in versions.values())
    assert {v for vs in versions.values() for v in vs} == {0, 1}

    checkpoint = load_latest(run)
    assert checkpoint is not None and checkpoint.state.step == 2
    assert (checkpoint.path / SHARDED / "learner.json").is_file()

    # The world-size-2 checkpoint resumes on one learner process (DCP reshards) and goes on.
    train(config(run, "steps=3"), console=Console(quiet=True))
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "learner/lr" in r]
    assert steps == [1, 2, 3]
    last = load_latest(run)
    assert last is not None and last.state.step == 3
