"""`masenvs mas-graph`: list, export or draw the designs an auto-MAS run recorded.

masenvs mas-graph runs/auto_mas                   # the best design of the last step, as PNG
masenvs mas-graph runs/auto_mas --list            # every design: step, task, reward, cause
masenvs mas-graph runs/auto_mas --design ID --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from masenvs.mas.graph import DesignGraph


def read_designs(path: Path) -> list[dict[str, Any]]:
    """The records of a run's `designs.jsonl` (a run directory or the file itself)."""
    if path.is_dir():
        path = path / "designs.jsonl"
    if not path.is_file():
        raise SystemExit(f"no designs at {path}: give a run directory of an auto_mas run")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                records.append(json.loads(line))
            except ValueError:
                raise SystemExit(f"{path}:{number} is not a JSON line") from None
    return records


def pick(records: list[dict[str, Any]], design_id: str | None) -> dict[str, Any]:
    """The design named `design_id`, else the best-rewarded one of the last step that ran."""
    if design_id is not None:
        for record in records:
            if record.get("design_id") == design_id:
                return record
        raise SystemExit(f"no design {design_id!r}; `--list` shows them")
    ran = [r for r in records if r.get("graph")]
    if not ran:
        raise SystemExit("no design in this run executed far enough to have a graph (`--list`)")
    last = max(r["step"] for r in ran)
    return max((r for r in ran if r["step"] == last), key=lambda r: r.get("reward", 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="masenvs mas-graph", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a run directory or its designs.jsonl")
    parser.add_argument("--design", help="design id (default: the last step's best)")
    parser.add_argument(
        "-o", "--output", type=Path, help="PNG to write (default: RUN/design-ID.png)"
    )
    parser.add_argument("--json", action="store_true", help="print the graph as JSON instead")
    parser.add_argument("--list", action="store_true", help="list the designs")
    args = parser.parse_args(argv)
    records = read_designs(args.source)
    console = Console()
    if args.list:
        table = Table("step", "task", "design", "reward", "agents", "result")
        for r in records:
            graph = r.get("graph") or {}
            table.add_row(
                str(r["step"]),
                str(r.get("task_id")),
                str(r.get("design_id")),
                f"{r.get('reward', 0.0):+.2f}",
                str(len(graph.get("nodes", []))),
                (r.get("error") or graph.get("structure", ""))[:60],
            )
        console.print(table)
        return 0
    record = pick(records, args.design)
    graph = DesignGraph.from_dict(
        record["graph"] or {"structure": "(did not run)", "nodes": [], "edges": []}
    )
    if args.json:
        print(
            json.dumps(
                {"design_id": record["design_id"], "code": record.get("design"), **graph.to_dict()},
                indent=2,
            )
        )
        return 0
    run_dir = args.source if args.source.is_dir() else args.source.parent
    out = args.output or run_dir / f"design-{record['design_id']}.png"
    title = f"design {record['design_id']} (step {record['step']}, reward {record.get('reward', 0.0):+.2f})"
    graph.render(out, title=title)
    console.print(f"{graph.structure}\n{out}")
    return 0
