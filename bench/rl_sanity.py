"""RL sanity on the real model: SmolLM2-135M learns a rule it follows only sometimes.

    python bench/rl_sanity.py [--steps 8] [--mode per_agent] [--finetune lora] [--seed 0]

The `say` env's `echo` task asks each agent to say back a made-up word (`Say kavo.`), a new
word per task, so validation (32 held-out task seeds, greedy) measures the rule, not a
memorised answer. The base model echoes some words and decorates or changes others. The
run trains through the whole loop (tree rollouts, endpoint, embedded engine, learner, weight
sync) and prints greedy validation success before and after, with the wall time; it exits 1
when success did not rise by `--min-gain` points. The fast checks (a fixed-word bandit on
the tiny model, injected bugs) are tests/test_rl_sanity.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from masenvs.cache import SMOLLM2_135M
from masenvs.trainer.config import load_config
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mode", default="per_agent", choices=["shared", "per_agent"])
    parser.add_argument("--finetune", default="lora", choices=["lora", "full"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-gain", type=float, default=20.0, help="points of val success")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-rl-sanity"))
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    lr = "1e-5" if args.finetune == "full" else "1e-3"
    overrides = [
        f"run_dir={args.run_dir}",
        f"model.name={SMOLLM2_135M}",
        "env.name=say",
        "env.options={task: echo}",
        f"seed={args.seed}",
        f"steps={args.steps}",
        "rollout.branches=4",
        "rollout.tasks_per_step=8",
        "rollout.max_rounds=1",
        "rollout.max_tokens=8",
        "rollout.temperature=0.7",
        "rollout.concurrency=32",
        f"optim.lr={lr}",
        "optim.warmup_steps=1",
        f"policy.mode={args.mode}",
        f"policy.finetune={args.finetune}",
        f"validation.every={args.steps}",
        "validation.episodes=32",
        f"checkpoint.every={args.steps}",
        "logging.tensorboard=false",
        "logging.entropy=false",
        *args.set,
    ]
    started = time.perf_counter()
    train(load_config(None, overrides))
    wall = time.perf_counter() - started
    records = read_metrics(args.run_dir / "metrics.jsonl")
    val = [(r["step"], r["val/success"]) for r in records if "val/success" in r]
    gain = 100 * (val[-1][1] - val[0][1])
    print(
        f"say/echo, {args.mode} {args.finetune}, seed {args.seed}: greedy validation "
        + " -> ".join(f"{v:.1%} (step {s})" for s, v in val)
        + f", {gain:+.1f} points, {wall:.0f} s"
    )
    return 0 if gain >= args.min_gain else 1


if __name__ == "__main__":
    sys.exit(main())
