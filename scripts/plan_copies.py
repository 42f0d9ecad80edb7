"""Does plan-path's plan agent read the board or copy the tool's proposal? From an RL run's
traces: in bands of steps, the share of the plan's sampled answers whose moves are the proposal
it was shown, and how many of the copies and of the others the team reward paid (issue 46).

    python scripts/plan_copies.py runs/cold/s0/rl [--band 5]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

MOVES = re.compile(r"####\s*(\[.*?\])")
SHOWN = re.compile(r"The tool agent proposes:\n(.*?)\n", re.S)


def moves(text: str | None) -> str | None:
    """The move list after `####`, spaces dropped; None for a reply without one."""
    found = MOVES.search(text or "")
    return found[1].replace(" ", "") if found else None


def plan_rewards(run: Path) -> dict[tuple[str, int], tuple[int, float]]:
    """(call id, choice) -> (step, reward) of every plan sample the learner saw."""
    out = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        if sample["agent"] == "plan":
            out[(sample["call_id"], sample["choice"])] = (sample["step"], sample["reward"])
    return out


def bands(run: Path, width: int) -> dict[int, list[int]]:
    """Band -> [copies, copies paid, others, others paid] over the run's plan samples."""
    rewards, counts = plan_rewards(run), defaultdict(lambda: [0, 0, 0, 0])
    for path in sorted((run / "traces").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            call = json.loads(line)
            if call.get("agent") != "plan" or not call.get("choices"):
                continue
            shown = SHOWN.search(call["messages"][-1]["content"])
            proposal = moves(shown[1]) if shown else None
            for i, choice in enumerate(call["choices"]):
                if (call["id"], choice.get("index", i)) not in rewards:
                    continue
                step, reward = rewards[(call["id"], choice.get("index", i))]
                row = counts[(step - 1) // width]
                other = 2 * (moves(choice["text"]) != proposal)
                row[other] += 1
                row[other + 1] += reward > 0
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="an RL run folder (samples.jsonl, traces/)")
    parser.add_argument("--band", type=int, default=5, help="steps per line")
    args = parser.parse_args(argv)
    counts = bands(args.run, args.band)
    if not counts:
        raise SystemExit(f"{args.run}: no plan samples with traces (plan-path's team run?)")
    for band in sorted(counts):
        copies, paid, others, others_paid = counts[band]
        first = band * args.band + 1
        print(
            f"steps {first}-{first + args.band - 1}: plan samples copying the proposal "
            f"{copies}/{copies + others} ({copies / (copies + others):.0%}), paid {paid}; "
            f"others {others}, paid {others_paid}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
