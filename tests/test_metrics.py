"""Metrics JSONL (with resume truncation), TensorBoard events, and the curves PNG."""

from __future__ import annotations

import json
from pathlib import Path

from masenvs.trainer.config import LoggingConfig
from masenvs.trainer.run.metrics import MetricsLogger, read_metrics, sample_metrics
from masenvs.trainer.run.plots import plot_curves
from masenvs.trainer.samples import Sample


def test_jsonl_and_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=True)) as log:
        log.log(1, {"train/reward/coder": 0.5, "learner/lr": 1e-5, "bad": float("nan")})
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["step"] == 1 and record["train/reward/coder"] == 0.5 and record["bad"] is None
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_resume_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    cfg = LoggingConfig(tensorboard=False)
    with MetricsLogger(tmp_path, cfg) as log:
        for step in range(1, 6):
            log.log(step, {"x": step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "x"')  # torn line from a kill mid-write
    # The run was checkpointed at step 3, killed at step 5: steps 4-5 are redone.
    with MetricsLogger(tmp_path, cfg, resume_step=3) as log:
        for step in range(4, 6):
            log.log(step, {"x": step * 10})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1), (2, 2), (3, 3), (4, 40), (5, 50),
    ]  # fmt: skip


def test_sample_metrics_per_agent() -> None:
    samples = [
        Sample([1], [2, 3], [], "coder", "coder", (0,), 1.0),
        Sample([1], [2], [], "coder", "coder", (0,), 0.0),
        Sample([1], [2, 3, 4], [], "tester", "tester", (1,), 2.0),
    ]
    assert sample_metrics(samples) == {
        "train/reward/coder": 0.5,
        "train/completion_tokens/coder": 1.5,
        "train/reward/tester": 2.0,
        "train/completion_tokens/tester": 3.0,
    }


def test_curves_png(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = []
    for step in range(1, 31):
        record = {"step": step, "train/reward/coder": step / 30, "train/success": step / 40}
        if step % 10 == 0:
            record |= {"val/reward/coder": step / 35, "val/success": step / 45}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    out = plot_curves(path, tmp_path / "curves.png", title="test run")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*.tmp.png"))
    # An empty run still draws (both panels say "no data yet").
    assert plot_curves([], tmp_path / "empty.png").stat().st_size > 5_000
