"""Paired vs committed team credit (`rollout.team_credit`): does the first mover's advantage
move? Trains each config twice, side by side, and prints a table from the runs' files.

Per run, from `samples.jsonl`, the first mover's (the tool's) groups (task, round, tool):
`spread`, the share of them whose rewards differ (a group with equal rewards has advantage 0);
`adv std`, the mean std of the tool's advantages over a step's samples (0 for dropped
groups); `team std`, the mean within-group std of the team term the tool got (0 under
committed credit, by construction); `team varies`, the share of groups whose team terms
differ: the groups a global-reward-only ablation (reward_weights process=agent=0) would
still train. From `metrics.jsonl`: the tool's mean reward per step
(its curve), the success rate and `train/paired_calls`. Also the wall time of each run.

    python bench/team_credit.py                       # quickstart and learning/math, 3 steps
    python bench/team_credit.py --steps 2 --configs examples/quickstart.yaml
    python bench/team_credit.py --no-train           # the table of the runs already there
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CONFIGS = ["examples/quickstart.yaml", "examples/learning/math.yaml"]
CREDITS = ["committed", "paired"]


def train(config: str, credit: str, steps: int, run_dir: Path) -> float:
    """One short training run (no validation, no plots); its wall time in seconds."""
    sets = {
        "steps": steps,
        "run_dir": str(run_dir),
        "rollout.team_credit": credit,
        "validation.every": 0,
        "checkpoint.every": steps,
        "checkpoint.resume": "false",
        "logging.plot_every": 0,
        "logging.tensorboard": "false",
    }
    cmd = [sys.executable, "-m", "masenvs", "train", config]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    started = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.time() - started


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_mover_stats(run_dir: Path, agent: str) -> dict[str, Any]:
    """The first mover's group spread, advantage std and team-term std, over all steps."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    by_step: dict[int, list[float]] = defaultdict(list)
    own: dict[int, list[float]] = defaultdict(list)  # its reward without the team term
    for r in read_jsonl(run_dir / "samples.jsonl"):
        if r["agent"] != agent:
            continue
        groups[(r["step"], *map(str, r["group"]))].append(r)
        by_step[r["step"]].append(r["advantage"] or 0.0)
        own[r["step"]].append(r["reward"] - (r["team_term"] or 0.0))
    spread = [len({r["reward"] for r in g}) > 1 for g in groups.values()]
    team_std = [statistics.pstdev([r["team_term"] or 0.0 for r in g]) for g in groups.values()]
    team_varies = [std > 0 for std in team_std]
    return {
        "groups": len(groups),
        "spread": sum(spread) / max(len(spread), 1),
        "adv_std": statistics.fmean(statistics.pstdev(a) for a in by_step.values()),
        "team_std": statistics.fmean(team_std) if team_std else 0.0,
        "team_varies": sum(team_varies) / max(len(team_varies), 1),
        "own": [statistics.fmean(own[step]) for step in sorted(own)],
    }


def curves(run_dir: Path, agent: str) -> dict[str, list[float]]:
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/success" in r]
    return {
        "reward": [r.get(f"train/reward/{agent}", float("nan")) for r in records],
        "success": [r["train/success"] for r in records],
        "paired_calls": [r.get("train/paired_calls", 0.0) for r in records],
    }


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--agent", default="tool", help="the first mover whose credit is measured")
    parser.add_argument("--out", default="runs/bench-team-credit")
    parser.add_argument("--no-train", action="store_true", help="tabulate the runs in --out")
    args = parser.parse_args()
    print(f"{cpu()}; {load()} at start")
    rows = []
    for config in args.configs:
        for credit in CREDITS:
            run_dir = Path(args.out) / f"{Path(config).stem}-{credit}"
            wall = float("nan") if args.no_train else train(config, credit, args.steps, run_dir)
            stats = first_mover_stats(run_dir, args.agent)
            rows.append((Path(config).stem, credit, wall, stats, curves(run_dir, args.agent)))
            print(f"  {config} {credit}: {wall:.0f} s; {load()}", flush=True)
    head = f"{'config':<12} {'credit':<10} {'wall s':>6} {'groups':>6} {'spread':>6} "
    head += f"{'adv std':>7} {'team std':>8} {'team varies':>11}  "
    head += "per step: reward / own reward / success / calls"
    print(head)
    for name, credit, wall, s, c in rows:
        curve = " ".join(f"{r:+.2f}" for r in c["reward"])
        success = " ".join(f"{x:.2f}" for x in c["success"])
        calls = " ".join(f"{x:.0f}" for x in c["paired_calls"])
        own = " ".join(f"{x:+.2f}" for x in s["own"])
        print(
            f"{name:<12} {credit:<10} {wall:>6.0f} {s['groups']:>6} {s['spread']:>6.0%} "
            f"{s['adv_std']:>7.2f} {s['team_std']:>8.2f} {s['team_varies']:>11.0%}  "
            f"{curve} / {own} / {success} / {calls}"
        )
    print(load(), "at the end")


if __name__ == "__main__":
    main()
