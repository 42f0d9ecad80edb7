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


# -- a run that cannot learn says so ----------------------------------------------------------

# Below this share of optim.lr a step's update is too small to change any answer.
TINY_LR = 0.01


def schedule_warning(cfg: TrainConfig) -> str | None:
    """A learning-rate schedule that never reaches `optim.lr` (warmup as long as the run)."""
    warmup, steps = cfg.optim.warmup_steps, cfg.steps
    if warmup <= steps:  # the last step at least reaches optim.lr
        return None
    peak = steps / warmup
    return (
        f"optim.warmup_steps={warmup} is longer than the run (steps={steps}): the learning "
        f"rate stays at or below {peak:.0%} of optim.lr={cfg.optim.lr:g} all run long and the "
        f"weights barely move; set optim.warmup_steps below steps "
        f"(e.g. --set optim.warmup_steps={steps // 10})"
    )


def step_warnings(step: int, row: Mapping[str, Any], cfg: TrainConfig, trained: bool) -> list[str]:
    """Each reason the update of `step` could not move the weights, in one line each: no
    sample, every group flat (all advantages 0), a learning rate ~0, a zero gradient."""
    out = []
    if not trained:
        return out  # the loop says why there was no update (no trainable sample)
    groups, flat = row.get("groups/groups", 0.0), row.get("groups/zero_std", 0.0)
    if groups and flat >= groups:
        out.append(
            f"step {step}: all {int(groups)} groups had equal rewards, so every advantage is 0 "
            "and this update cannot move the weights; give groups a spread (more "
            "rollout.branches, a higher rollout.temperature, tasks the model solves sometimes)"
        )
    lr = row.get("learner/lr")
    if lr is not None and lr < TINY_LR * cfg.optim.lr:
        out.append(
            f"step {step}: the learning rate is {lr:.3g}, under {TINY_LR:.0%} of "
            f"optim.lr={cfg.optim.lr:g} (optim.warmup_steps={cfg.optim.warmup_steps}): this "
            "update barely moves the weights"
        )
    for key, value in row.items():
        if key.startswith("learner/") and key.endswith("/grad_norm") and value == 0.0:
            policy = key.removeprefix("learner/").removesuffix("/grad_norm")
            out.append(
                f"step {step}: policy {policy}'s gradient is 0 (loss "
                f"{row.get(f'learner/{policy}/loss', 0.0):.3g}): its weights did not change"
            )
    return out


def validation_warning(step: int, row: Mapping[str, Any]) -> str | None:
    """One line when validation episodes failed: they count as failures, so `val/success` is
    not comparable with a validation where none failed."""
    errors = int(row.get("val/errors", 0))
    if not errors:
        return None
    return (
        f"step {step}: {errors} of {int(row.get('val/episodes', errors))} validation episodes "
        "failed (errors above: a timeout, a dead server) and count as failures, so this "
        "val success is a lower bound, not comparable with a clean validation"
    )


def weight_snapshot(learner: Any) -> dict[str, list[Any]]:
    """A copy of each trained LoRA policy's weights (full fine-tuning and a distributed
    learner's ranks are not copied: too large, or not here)."""
    out = {}
    for name, policy in getattr(learner, "policies", {}).items():
        params = getattr(policy, "params", None)
        if params and getattr(policy, "lora", False) and not getattr(policy, "frozen", False):
            out[name] = [p.detach().clone() for p in params]
    return out


def weight_moves(learner: Any, start: Mapping[str, list[Any]]) -> dict[str, tuple[float, float]]:
    """Per policy: (||w - w_start||, that distance relative to ||w_start||)."""
    out = {}
    for name, before in start.items():
        now = learner.policies[name].params
        moved = sum(float((p.detach() - b).float().pow(2).sum()) for p, b in zip(now, before))
        size = sum(float(b.float().pow(2).sum()) for b in before)
        out[name] = (math.sqrt(moved), math.sqrt(moved / size) if size else math.inf)
    return out


def moves_line(moves: Mapping[str, tuple[float, float]]) -> str:
    """`adapters moved from their start: writer 0.0123 (0.41%), critic 0 (unchanged)`."""
    parts = [
        f"{name} {d:.3g} ({rel:.2%} of its start)" if d > 0 else f"{name} 0 (unchanged)"
        for name, (d, rel) in moves.items()
    ]
    return "adapters moved from their start (L2 norm of the change): " + ", ".join(parts)
