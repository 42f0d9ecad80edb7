"""The learning table of issue 46 from `scripts/cold_start_then_rl.py` runs: one markdown row per
seed, and one PNG of the curves (greedy validation success; each role's sampled reward).

    python scripts/cold_start_table.py runs/cold-s0 runs/cold-s1 runs/cold-s2 \
        [--base runs/base-s0] --png docs/learning/cold-start/curves.png

Each OUT holds summary.json and rl/metrics.jsonl; --base a `masenvs train` run from the base model
(its eval.json beside the metrics) for the base rows and curves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ORDER = ("tool", "plan")  # the team's turn order; a single-agent run has the plan alone


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def roles(outs: list[Path]) -> list[str]:
    """The roles the runs trained (their metrics' train/reward/ROLE), the team's order first."""
    found = {
        key.removeprefix("train/reward/")
        for out in outs
        for m in rows(out / "rl")
        for key in m
        if key.startswith("train/reward/")
    }
    return sorted(found, key=lambda r: (ORDER.index(r) if r in ORDER else len(ORDER), r))


def first_last(metrics: list[dict], key: str) -> str:
    values = [m[key] for m in metrics if key in m]
    if not values:
        return "-"
    # the mean of the first and of the last two steps: one step of 8 tasks is noisy
    head, tail = values[:2], values[-2:]
    return f"{sum(head) / len(head):+.2f} -> {sum(tail) / len(tail):+.2f}"


def greedy_rewards(metrics: list[dict], role: str) -> str:
    """A role's reward on the greedy validation tasks (the same tasks each time), first -> last."""
    values = [m[f"val/reward/{role}"] for m in metrics if f"val/reward/{role}" in m]
    return f"{values[0]:+.2f} -> {values[-1]:+.2f}" if values else "-"


def groups_learned(out: Path, metrics: list[dict], role: str) -> str:
    """How many of a role's groups had rewards that differ, so GRPO learned from them, of all
    its groups (`drop_zero_std_groups` drops the rest): a role that copies another's answer
    gets none."""
    rollout = yaml.safe_load((out / "rl" / "config.yaml").read_text())["rollout"]
    kept = sum(m.get(f"learner/{role}/samples", 0) for m in metrics) / rollout["branches"]
    groups = sum("train/success" in m for m in metrics) * rollout["tasks_per_step"]
    return f"{kept:.0f} of {groups}"


def validation(metrics: list[dict]) -> str:
    return " / ".join(f"{m['val/success']:.0%}" for m in metrics if "val/success" in m)


def result(path: Path) -> dict:
    """An eval JSON's first result ({} when the eval did not run)."""
    return json.loads(path.read_text())["results"][0] if path.is_file() else {}


def greedy(path: Path) -> float | None:
    return result(path).get("avg")


def exact_stop(path: Path) -> str:
    """The share of answers that stop on G (plan-path): success that no move past G pads."""
    value = result(path).get("metrics", {}).get("exact_stop")
    return "-" if value is None else f"{value:.1%}"


def seed_row(out: Path, names: list[str], exact: bool) -> str:
    """One run's row: from its evals (a run stopped before summary.json still has them)."""
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    )
    metrics = rows(out / "rl")
    sft, rl = greedy(out / "eval_sft.json"), greedy(out / "eval_rl.json")
    control = greedy(out / "eval_sft_continued.json")
    rl_seconds = summary.get("seconds", {}).get("rl", metrics[-1]["time"] - metrics[0]["time"])
    cells = [
        out.name,
        f"{sft:.1%}",
        f"**{rl:.1%}** ({(rl - sft) * 100:+.1f})",
        *([f"{exact_stop(out / 'eval_sft.json')} -> {exact_stop(out / 'eval_rl.json')}"] * exact),
        "-" if control is None else f"{control:.1%}",
        validation(metrics),
        *(first_last(metrics, f"train/reward/{role}") for role in names),
        " ; ".join(greedy_rewards(metrics, role) for role in names),
        " ; ".join(groups_learned(out, metrics, role) for role in names),
        f"{rl_seconds / 60:.1f} min",
    ]
    return "| " + " | ".join(cells) + " |"


def header(names: list[str], exact: bool) -> str:
    cells = [
        "run",
        "SFT (greedy, 64 tasks)",
        "after RL (64 tasks)",
        *(["exact stop on G, SFT -> RL"] * exact),
        "SFT continued",
        "greedy validation during RL (32 tasks)",
        *(f"{role} reward (first 2 -> last 2 steps)" for role in names),
        f"{' ; '.join(names)} reward on the greedy validation tasks (first -> last)",
        f"{' ; '.join(names)} groups learned from (rewards differ)",
        "RL wall",
    ]
    return f"| {' | '.join(cells)} |\n|{' --- |' * len(cells)}"


def plot(outs: list[Path], base: Path | None, control: Path | None, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = roles(outs)
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5 * (1 + len(names)), 4.2))
    runs = [(o.name, o / "rl") for o in outs]
    if base is not None:
        runs.append((f"{base.name} (RL from the base model)", base))
    for label, run in runs:
        metrics = rows(run)
        style = "--" if run == base else "-"
        val = [(m["step"], m["val/success"]) for m in metrics if "val/success" in m]
        axes[0].plot(*zip(*val, strict=True), style, marker="o", label=label)
        for ax, role in zip(axes[1:], names, strict=True):
            key = f"train/reward/{role}"
            pts = [(m["step"], m[key]) for m in metrics if key in m]
            if pts:
                (line,) = ax.plot(*zip(*pts, strict=True), style, alpha=0.35, label=label)
            val = [
                (m["step"], m[f"val/reward/{role}"]) for m in metrics if f"val/reward/{role}" in m
            ]
            if pts and val:
                ax.plot(*zip(*val, strict=True), style, marker="o", color=line.get_color())
    sft = greedy(outs[0] / "eval_sft.json")
    if sft is not None:
        axes[0].axhline(
            sft, color="black", linestyle=":", label="the SFT checkpoint (greedy, 64 tasks)"
        )
    if control is not None:
        value = greedy(control)
        label = "SFT continued: the control (64 tasks)"
        axes[0].axhline(value, color="grey", linestyle="-.", label=label)
    axes[0].set(title="greedy validation success, 32 tasks", xlabel="RL step", ylabel="success")
    for ax, role in zip(axes[1:], names, strict=True):
        ax.set(
            title=f"{role} agent's reward: sampled (faint), greedy val (dots)",
            xlabel="RL step",
        )
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outs", nargs="+", type=Path, help="OUT folders of the pipeline script")
    parser.add_argument("--base", type=Path, help="a `masenvs train` run from the base model")
    parser.add_argument("--control", type=Path, help="the SFT-continued checkpoint's eval JSON")
    parser.add_argument("--png", type=Path, help="where to write the curves")
    args = parser.parse_args(argv)
    names = roles(args.outs)
    # plan-path's evals count the answers that stop on G; other envs have no such column
    exact = any("exact_stop" in result(o / "eval_sft.json").get("metrics", {}) for o in args.outs)
    print(header(names, exact))
    for out in args.outs:
        print(seed_row(out, names, exact))
    pairs = [(greedy(o / "eval_sft.json"), greedy(o / "eval_rl.json")) for o in args.outs]
    gains = [rl - sft for sft, rl in pairs if sft is not None and rl is not None] or [0.0]
    print(f"\nRL minus SFT, greedy on 64 tasks: {', '.join(f'{g * 100:+.1f}' for g in gains)} "
          f"points (mean {sum(gains) / len(gains) * 100:+.1f})")  # fmt: skip
    if args.base is not None:
        metrics = rows(args.base)
        report = result(args.base / "eval.json")
        print(
            f"\nRL from the base model: greedy {report['avg']:.1%} after RL (64 tasks); validation "
            f"{validation(metrics)}; tool {first_last(metrics, 'train/reward/tool')}, plan "
            f"{first_last(metrics, 'train/reward/plan')}"
        )
    if args.png is not None:
        plot(args.outs, args.base, args.control, args.png)
        print(f"\ncurves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
