"""Replay a plan-path run's training calls through the env: what every candidate was paid.

    python scripts/plan_path_replay.py RUN_DIR [--old-parser] [--set key=value ...]

Reads the sampled answers from RUN_DIR/traces (calls `s<step>-<seed>`), replays each tool
candidate from the task's start and each plan candidate after the best tool candidate (as
tree sampling committed it), and prints per step and agent: mean reward, the spread inside a
group, pass@K, hit rate, format failures, flat groups and the mean number of moves; then
the reward and group advantage by answer length; then whether the answers carry task
information: each tool answer's hit rate on its own task against the other tasks of the
step (equal rates: the answers ignore the task). `--old-parser` scores as before issue 33
(prose after the answer counted as moves). `--set` takes the run's env options (defaults:
the quickstart's, without show_offset).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import statistics
from pathlib import Path

import yaml

import masenvs
import masenvs.envs.plan_path as plan_path
from masenvs.parsing import answer_segment, parse_moves

# The move pattern as it was before issue 33, kept here: the old parser must not follow changes
# to masenvs.parsing's own.
OLD_MOVE = re.compile(r"(?i)\b(up|down|left|right)\b|\b([UDLRudlr]+)\b")
MOVE_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R"}


def old_parse_moves(text: str, max_moves: int = 10_000, marker: str = "####") -> list[str] | None:
    """parse_moves before issue 33: every move word or letter after the last marker."""
    segment = answer_segment(text, marker)
    if segment is None:
        return None
    moves: list[str] = []
    for word, letters in OLD_MOVE.findall(segment):
        moves.extend([MOVE_WORDS[word.lower()]] if word else letters.upper())
    return moves or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--old-parser", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    parse = old_parse_moves if args.old_parser else parse_moves
    if args.old_parser:
        plan_path.parse_moves = old_parse_moves
    opts = dict(size=4, obstacle_ratio=0.1, tool_task="propose", show_offset=False, max_rounds=1)
    for item in args.set:
        key, _, value = item.partition("=")
        opts[key] = yaml.safe_load(value)
    calls: dict[str, dict[str, list[str]]] = collections.defaultdict(dict)
    for f in glob.glob(str(args.run / "traces" / "*.jsonl")):
        for line in Path(f).read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if d.get("type") == "call" and re.match(r"s\d+-\d+$", d["rollout_id"]):
                calls[d["rollout_id"]][d["agent"]] = [c["text"] for c in d["choices"]]
    env = masenvs.make("plan_path", **opts)

    def tool_hit(seed: int, text: str) -> bool:
        env.reset(seed=seed)
        _, _, _, _, infos = env.step({"tool": text})
        return infos["tool"]["reward_parts"]["agent"] >= 1

    rows: dict[int, dict[str, list]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    by_length: dict[int, list[tuple[float, float, bool]]] = collections.defaultdict(list)
    for rid, agents in calls.items():
        step, seed = map(int, re.match(r"s(\d+)-(\d+)", rid).groups())
        env.reset(seed=seed)
        start = env.snapshot()
        tool = []
        for text in agents.get("tool", []):
            env.restore(start)
            _, r, _, _, infos = env.step({"tool": text})
            parts = infos["tool"]["reward_parts"]
            tool.append((r["tool"], parts["agent"] >= 1, parts["agent"] <= -1, text))
        if not tool:
            continue
        best = max(range(len(tool)), key=lambda i: tool[i][0])  # first of equals, as committed
        env.restore(start)
        env.step({"tool": tool[best][3]})
        after_tool = env.snapshot()
        plan = []
        for text in agents.get("plan", []):
            env.restore(after_tool)
            _, r, _, _, infos = env.step({"plan": text})
            parts = infos["plan"]["reward_parts"]
            plan.append((r["plan"], infos["plan"]["success"], parts["agent"] <= -1, text))
        for name, cands in (("tool", tool), ("plan", plan)):
            if not cands:
                continue
            rewards = [c[0] for c in cands]
            row = rows[step]
            row[f"{name} reward"] += rewards
            row[f"{name} std"].append(statistics.pstdev(rewards))
            row[f"{name} pass"].append(any(c[1] for c in cands))
            row[f"{name} hit"] += [c[1] for c in cands]
            row[f"{name} format"] += [c[2] for c in cands]
            row[f"{name} flat"].append(len(set(rewards)) == 1)
            row[f"{name} moves"] += [len(parse(c[3]) or []) for c in cands]
        mean, std = statistics.fmean(c[0] for c in tool), statistics.pstdev(c[0] for c in tool)
        for r, hit, bad, text in tool:
            n = -1 if bad else min(len(parse(text) or []), 6)
            by_length[n].append((r, (r - mean) / (std + 1e-6) if std > 0 else 0.0, hit))

    print(
        "step | agent | mean reward | std in group | pass@K | hit rate | format fail | flat groups | moves"
    )
    for step in sorted(rows):
        row = rows[step]
        for a in ("tool", "plan"):
            if not row[f"{a} reward"]:
                continue
            m = lambda k, row=row, a=a: statistics.fmean(row[f"{a} {k}"])  # noqa: E731
            print(
                f"{step} | {a} | {m('reward'):+.2f} | {m('std'):.2f} | {m('pass'):.0%} | "
                f"{m('hit'):.0%} | {m('format'):.0%} | {m('flat'):.0%} | {m('moves'):.1f}"
            )
    print(
        "\ntool answer moves (-1: unparsable) | answers | mean reward | mean advantage | hit rate"
    )
    for n in sorted(by_length):
        v = by_length[n]
        print(
            f"{n} | {len(v)} | {statistics.fmean(x[0] for x in v):+.2f} | "
            f"{statistics.fmean(x[1] for x in v):+.2f} | {statistics.fmean(x[2] for x in v):.0%}"
        )
    print("\nstep | tool answers | hit rate on own task | on the other tasks of the step")
    steps = sorted({int(re.match(r"s(\d+)-", rid).group(1)) for rid in calls})
    for step in steps:
        tasks = {
            int(rid.rsplit("-", 1)[1]): a["tool"]
            for rid, a in calls.items()
            if rid.startswith(f"s{step}-") and "tool" in a
        }
        own = [tool_hit(seed, t) for seed, texts in tasks.items() for t in texts]
        other = [
            tool_hit(s2, t)
            for seed, texts in tasks.items()
            for t in texts
            for s2 in tasks
            if s2 != seed
        ]
        if own:
            print(
                f"{step} | {len(own)} | {statistics.fmean(own):.0%} | {statistics.fmean(other):.0%}"
            )


if __name__ == "__main__":
    main()
