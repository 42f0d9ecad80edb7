"""Reward and success curves of a run as one PNG (train and validation, per agent)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe in worker threads

import matplotlib.pyplot as plt  # noqa: E402

from masenvs.trainer.run.metrics import read_metrics  # noqa: E402


def plot_curves(
    metrics: str | Path | Sequence[dict[str, Any]], out: str | Path, title: str | None = None
) -> Path:
    """Draw `train|val/reward/<agent>` and `train|val/success[/<agent>]` from a metrics.jsonl.

    Training curves show the raw values faintly and a moving average on top; validation
    points are markers joined by dashed lines.
    """
    records = read_metrics(metrics) if isinstance(metrics, str | Path) else list(metrics)
    fig, (ax_reward, ax_success) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    colors = _Colors()
    _panel(ax_reward, records, "reward", colors)
    _panel(ax_success, records, "success", colors)
    ax_reward.set_title("Reward")
    ax_success.set_title("Success rate")
    ax_success.set_ylim(-0.03, 1.03)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)  # a viewer never sees a half-written image
    return out


def _panel(ax: Any, records: list[dict[str, Any]], what: str, colors: _Colors) -> None:
    drawn = False
    for split in ("train", "val"):
        prefix = f"{split}/{what}"
        keys = sorted({k for r in records for k in r if k == prefix or k.startswith(prefix + "/")})
        for key in keys:
            label = key[len(prefix) + 1 :] or "team"
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            color = colors[label]
            if split == "train":
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(
                    steps, _moving_average(values), color=color, linewidth=2, label=f"train {label}"
                )
            else:
                ax.plot(
                    steps, values, color=color, linestyle="--", marker="o", markersize=4,
                    linewidth=1.2, label=f"val {label}",
                )  # fmt: skip
            drawn = True
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


def _moving_average(values: Sequence[float], window: int = 0) -> list[float]:
    """Trailing mean over ~5% of the run (at least 1, at most 25 points)."""
    window = window or max(1, min(25, len(values) // 20))
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class _Colors:
    """One color per agent name, the same in both panels."""

    def __init__(self) -> None:
        self._cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        self._assigned: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self._assigned:
            self._assigned[name] = self._cycle[len(self._assigned) % len(self._cycle)]
        return self._assigned[name]
