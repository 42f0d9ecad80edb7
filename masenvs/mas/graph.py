"""A design as data: its agents (nodes), who feeds whom (edges), and each node's LLM calls
by trace id. Stored with every auto-MAS episode; `masenvs mas-graph` renders it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from masenvs.mas.blocks import Agent, Block


@dataclass
class Node:
    name: str
    system: str = ""  # the agent's system prompt (first 500 characters)
    calls: list[str] = field(default_factory=list)  # trace ids of its LLM calls, in order


@dataclass
class DesignGraph:
    structure: str  # e.g. "Sequential(Ensemble(a, b, judge), Reflect(fixer, checker))"
    nodes: list[Node]
    edges: list[tuple[str, str]]

    @classmethod
    def of(cls, block: Block, calls: dict[str, list[str]] | None = None) -> DesignGraph:
        """The graph of `block`; `calls` maps node names to trace ids (`LLM.calls_by_node`)."""
        calls = calls or {}
        nodes: dict[str, Node] = {}
        for b in block.walk():
            if isinstance(b, Agent) and b.name not in nodes:
                nodes[b.name] = Node(b.name, (b.system or "")[:500], list(calls.get(b.name, [])))
        edges = list(dict.fromkeys(block.edges()))
        return cls(block.describe(), list(nodes.values()), edges)

    def to_dict(self) -> dict[str, Any]:
        return {
            "structure": self.structure,
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [list(e) for e in self.edges],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DesignGraph:
        return cls(
            str(data.get("structure", "")),
            [
                Node(str(n["name"]), str(n.get("system", "")), list(n.get("calls", [])))
                for n in data.get("nodes", [])
            ],
            [(str(a), str(b)) for a, b in data.get("edges", [])],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self, path: str | Path, title: str | None = None) -> Path:
        """Draw the graph as a PNG: agents on a circle, arrows for edges, calls per node."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch

        path = Path(path)
        n = max(len(self.nodes), 1)
        # Clockwise from the top, in the order the design declares its agents.
        pos = {
            node.name: (math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n))
            for i, node in enumerate(self.nodes)
        }
        fig, ax = plt.subplots(figsize=(7, 7))
        for a, b in self.edges:
            if a not in pos or b not in pos:
                continue
            if a == b:  # a loop on one agent
                x, y = pos[a]
                ax.add_patch(
                    FancyArrowPatch(
                        (x - 0.08, y + 0.1),
                        (x + 0.08, y + 0.1),
                        connectionstyle="arc3,rad=-2.5",
                        arrowstyle="-|>",
                        mutation_scale=14,
                        color="#555",
                    )
                )
                continue
            ax.add_patch(
                FancyArrowPatch(
                    pos[a],
                    pos[b],
                    arrowstyle="-|>",
                    mutation_scale=16,
                    color="#555",
                    shrinkA=28,
                    shrinkB=28,
                    connectionstyle="arc3,rad=0.12",
                )
            )
        for node in self.nodes:
            x, y = pos[node.name]
            ax.text(
                x,
                y,
                f"{node.name}\n{len(node.calls)} call{'s' * (len(node.calls) != 1)}",
                ha="center",
                va="center",
                fontsize=10,
                bbox={"boxstyle": "round,pad=0.5", "fc": "#dbe9f6", "ec": "#2b6cb0"},
            )
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.5, 1.5)
        ax.set_aspect("equal")
        ax.axis("off")
        heading = title or "design"
        ax.set_title(f"{heading}\n{_wrap(self.structure, 70)}", fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _wrap(text: str, width: int) -> str:
    return "\n".join(text[i : i + width] for i in range(0, min(len(text), 4 * width), width))
