"""Success and reward curves of several runs (one per seed) in one PNG, and their before/after table.

    python scripts/learning_curves.py runs/quickstart-s0 runs/quickstart-s1 runs/quickstart-s2 \
        --out docs/img/quickstart.png --title "plan-path 4x4, tool + plan"

Reads each run's metrics.jsonl; prints a Markdown table (validation success and per-agent
reward at the first and last validation, and the wall time of the run) for docs/learning.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402


def read_run(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def validations(records: list[dict]) -> list[dict]:
    return [r for r in records if "val/success" in r]


def run_seconds(records: list[dict]) -> float | None:
    """Rollout + update seconds summed over steps (validation and startup not included)."""
    steps = [r for r in records if "time/rollout_s" in r]
    if not steps:
        return None
    return sum(r["time/rollout_s"] + r.get("time/update_s", 0.0) for r in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (one per seed)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args()

    runs = {run: read_run(run) for run in args.runs}
    agents = sorted(
        {
            k.split("/", 2)[2]
            for rs in runs.values()
            for r in rs
            for k in r
            if k.startswith("val/reward/")
        }
    )
    fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    print(
        "| run | seed | val success (first -> last) | "
        + " | ".join(f"val reward {a}" for a in agents)
        + " | wall after model load |"
    )
    print("| --- | --- | --- | " + " | ".join("---" for _ in agents) + " | --- |")
    for i, (run, records) in enumerate(runs.items()):
        vals = validations(records)
        steps = [v["step"] for v in vals]
        ax_s.plot(
            steps, [v["val/success"] for v in vals], "o-", color=colors[i % 10], label=run.name
        )
        trained = [r for r in records if "train/success" in r]
        ax_s.plot(
            [r["step"] for r in trained],
            [r["train/success"] for r in trained],
            ":",
            color=colors[i % 10],
            alpha=0.7,
            label=f"{run.name} sampled (train)",
        )
        for j, agent in enumerate(agents):
            key = f"val/reward/{agent}"
            ax_r.plot(
                steps,
                [v.get(key, float("nan")) for v in vals],
                "o-" if j == 0 else "s--",
                color=colors[i % 10],
                label=f"{run.name} {agent}",
            )
        config = yaml.safe_load((run / "config.yaml").read_text())
        seed = config.get("seed", "?")
        # config.yaml is written once the learner is loaded; the last metrics line ends the run.
        wall = records[-1]["time"] - (run / "config.yaml").stat().st_mtime
        first, last = vals[0], vals[-1]
        cells = [
            f"{first.get(f'val/reward/{a}', float('nan')):+.2f} -> {last.get(f'val/reward/{a}', float('nan')):+.2f}"
            for a in agents
        ]
        print(
            f"| {run.name} | {seed} | {first['val/success']:.0%} -> {last['val/success']:.0%} "
            f"(step {first['step']} -> {last['step']}) | "
            + " | ".join(cells)
            + f" | {wall / 60:.1f} min |"
        )
    ax_s.set_title("Success: greedy validation (o-), sampled training (:)")
    ax_s.set_xlabel("training step")
    ax_s.set_ylim(-0.03, 1.03)
    ax_r.set_title("Validation reward per agent (o plan/reasoner/first, s second)")
    ax_r.set_xlabel("training step")
    ax_s.legend(fontsize=7)
    ax_r.legend(fontsize=6)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
