"""Where a run's advantage mass went: groups with a solved candidate, format failures, or only
shaping differences.

    python scripts/advantage_mass.py RUN_DIR

Reads RUN_DIR/samples.jsonl (the kept samples and their advantages) and sorts each group by
what set its candidates apart: `solved` (a candidate earned a positive outcome reward, team or
agent), `format` (else: a candidate got a penalty with no process reward, an unparsable
answer), `shaping only` (the rest). With GRPO's division by the group's std every kept group
weighs alike, whatever its spread; `algorithm.scale_by_std: false` weighs them by it
(docs/learning.md, hint-free plan-path).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path


def kind_of(group: list[dict]) -> str:
    parts = [s["reward_parts"] for s in group]
    if any(p.get("team", 0) > 0 or p.get("agent", 0) > 0 for p in parts):
        return "solved"
    if any(p.get("agent", 0) < 0 and p.get("process", 0) == 0 for p in parts):
        return "format"
    return "shaping only"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    path = args.run_dir / "samples.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a run writes it as it trains)")
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if s.get("kept") and s.get("advantage") is not None:
            groups[(s["step"], tuple(s["group"]))].append(s)
    if not groups:
        raise SystemExit(f"{path}: no kept sample with an advantage")
    mass: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    spread: dict[str, list[float]] = collections.defaultdict(list)
    for group in groups.values():
        kind = kind_of(group)
        mass[kind] += sum(abs(s["advantage"]) for s in group)
        count[kind] += 1
        spread[kind].append(statistics.pstdev([s["reward"] for s in group]))
    total = sum(mass.values()) or 1.0
    print("groups | kind | share of sum |A| | median reward std in the group")
    for kind in ("solved", "format", "shaping only"):
        if count[kind]:
            print(
                f"{count[kind]} | {kind} | {mass[kind] / total:.0%} | "
                f"{statistics.median(spread[kind]):.3f}"
            )


if __name__ == "__main__":
    main()
