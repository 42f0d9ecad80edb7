"""What a task-blind policy scores on plan-path: the best fixed answer of each length.

    python scripts/plan_path_fixed_answers.py [--max-moves 8] [--set stop_at_goal=false ...]

Applies every move string up to `--max-moves` to all validation tasks (the trainer's
validation seeds, 1000000 onwards) and prints the best per length with its success rate: the
bar a hint-free recipe must clear before a rise in greedy success shows the task being read
(docs/learning.md, "A task-blind answer can pass the bar").
"""

from __future__ import annotations

import argparse
import itertools

import yaml

import masenvs
from masenvs.envs.plan_path import score_moves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-moves", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--seed-start", type=int, default=1_000_000)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    opts = dict(size=4, obstacle_ratio=0.1, tool_task="propose", max_rounds=1)
    for item in args.set:
        key, _, value = item.partition("=")
        opts[key] = yaml.safe_load(value)
    env = masenvs.make("plan_path", **opts)
    tasks = []
    for seed in range(args.seed_start, args.seed_start + args.tasks):
        env.reset(seed=seed)
        tasks.append(env.task)
    cfg = env.config
    print(f"plan_path {opts}: {len(tasks)} tasks")
    for length in range(1, args.max_moves + 1):
        best, best_hits = "", -1
        for moves in itertools.product("UDLR", repeat=length):
            hits = sum(score_moves(t, t.start, list(moves), cfg).reached for t in tasks)
            if hits > best_hits:
                best, best_hits = "".join(moves), hits
        print(f"{length} moves: {best} solves {best_hits / len(tasks):.1%}", flush=True)


if __name__ == "__main__":
    main()
