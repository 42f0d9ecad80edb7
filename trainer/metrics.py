"""Per-step metrics: `metrics.jsonl` in the run directory, TensorBoard, and W&B when enabled.

Names follow one scheme so plots and dashboards find them:
`train/reward/<agent>`, `train/success`, `val/reward/<agent>`, `val/success` (written by the
training loop), `groups/*` (advantage groups), `learner/<policy>/*` (loss, clip fractions,
KL, grad norm, log-prob mismatch) and `learner/lr`, `learner/tokens_per_s`.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from masenvs.trainer.atgrpo import GroupStats
from masenvs.trainer.config import LoggingConfig, TrainConfig
from masenvs.trainer.samples import Sample

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes one JSON line per `log` call, plus TensorBoard / W&B scalars.

    `resume_step` drops records after that step (written by a run that was killed before
    its next checkpoint), so a resumed run never logs a step twice.
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: LoggingConfig | None = None,
        config: TrainConfig | None = None,
        resume_step: int | None = None,
    ) -> None:
        cfg = cfg or LoggingConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            _truncate_after(self.path, resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)
        self._wandb = None
        if cfg.wandb:
            self._wandb = _start_wandb(self.run_dir, cfg.wandb_project, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` for training step `step` (numbers; non-finite become null)."""
        values = {k: _number(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file (a torn last line, from a kill mid-write, is skipped)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def sample_metrics(samples: Iterable[Sample], prefix: str = "train") -> dict[str, float]:
    """Mean reward and completion length per agent: `<prefix>/reward/<agent>`, ..."""
    rewards: dict[str, list[float]] = defaultdict(list)
    lengths: dict[str, list[int]] = defaultdict(list)
    for s in samples:
        rewards[s.agent].append(s.reward)
        lengths[s.agent].append(len(s.completion_token_ids))
    out: dict[str, float] = {}
    for agent in rewards:
        out[f"{prefix}/reward/{agent}"] = sum(rewards[agent]) / len(rewards[agent])
        out[f"{prefix}/completion_tokens/{agent}"] = sum(lengths[agent]) / len(lengths[agent])
    return out


def group_metrics(stats: GroupStats) -> dict[str, float]:
    return {f"groups/{k}": float(v) for k, v in asdict(stats).items()}


def _number(value: Any) -> float | None:
    value = float(value)  # tensors, numpy scalars, ints
    return value if math.isfinite(value) else None


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", -1) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _start_wandb(run_dir: Path, project: str, config: TrainConfig | None) -> Any:
    try:
        import wandb
    except ImportError:
        warnings.warn(
            "logging.wandb is on but wandb is not installed (pip install wandb); "
            "metrics still go to metrics.jsonl and TensorBoard",
            stacklevel=3,
        )
        return None
    id_file = run_dir / "wandb_id"  # one W&B run per run_dir, resumed after a restart
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id)
    return wandb.init(
        project=project,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        name=run_dir.name,
        config=config.model_dump(mode="json") if config is not None else None,
    )
