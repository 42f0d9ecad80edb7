"""AgentGraph: nodes by name, edges (optionally conditional), an entry and finish points."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .core import (
    Context,
    Message,
    MessageType,
    WorkflowNode,
    callback_failed,
    enter_run,
    exit_run,
)


@dataclass
class Edge:
    source: str
    target: str
    condition: Callable[[Context], bool] | None = None

    def should_follow(self, context: Context) -> bool:
        return self.condition is None or bool(self.condition(context))


class AgentGraph:
    """From the entry point, run a node, then follow its routing function or its first
    edge whose condition holds; stop at a finish point, a node with nowhere to go, or
    after `max_steps` nodes."""

    def __init__(self, name: str = "agent_graph", max_steps: int = 50) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
        self.name, self.max_steps = name, max_steps
        self.nodes: dict[str, WorkflowNode] = {}
        self.edges: list[Edge] = []
        self.entry_point: str | None = None
        self.finish_points: list[str] = []
        self._routing: dict[str, Callable[[Context], str]] = {}

    def add_node(self, name: str, node: WorkflowNode) -> AgentGraph:
        if not isinstance(node, WorkflowNode):
            raise TypeError(f"graph node {name!r} must be a node, got {type(node).__name__}")
        self.nodes[name] = node
        return self

    def add_edge(
        self, source: str, target: str, condition: Callable[[Context], bool] | None = None
    ) -> AgentGraph:
        for role, key in (("Source", source), ("Target", target)):
            if key not in self.nodes:
                raise ValueError(f"{role} node '{key}' not found")
        self.edges.append(Edge(source, target, condition))
        return self

    def add_conditional_edges(
        self, source: str, routing_func: Callable[[Context], str]
    ) -> AgentGraph:
        if source not in self.nodes:
            raise ValueError(f"Source node '{source}' not found")
        self._routing[source] = routing_func
        return self

    def set_entry_point(self, node_name: str) -> AgentGraph:
        if node_name not in self.nodes:
            raise ValueError(f"Entry point node '{node_name}' not found")
        self.entry_point = node_name
        return self

    def set_finish_point(self, node_name: str) -> AgentGraph:
        if node_name not in self.nodes:
            raise ValueError(f"Finish point node '{node_name}' not found")
        if node_name not in self.finish_points:
            self.finish_points.append(node_name)
        return self

    def next_nodes(self, current: str, context: Context) -> list[str]:
        if current in self._routing:
            try:
                target = self._routing[current](context)
            except Exception:
                callback_failed(f"the routing function of {current!r}")
                return []
            return [target] if target in self.nodes else []
        out = []
        for edge in self.edges:
            if edge.source != current:
                continue
            try:
                if edge.should_follow(context):
                    out.append(edge.target)
            except Exception:
                callback_failed(f"the condition of the edge to {edge.target!r}")
                continue
        return out

    def run(self, input_message: Any, initial_state: dict[str, Any] | None = None) -> Message:
        if self.entry_point is None:
            raise ValueError("Entry point not set. Call set_entry_point() first.")
        if not self.finish_points:
            raise ValueError("No finish points set. Call set_finish_point() at least once.")
        context = Context(state=dict(initial_state or {}))
        context.add_message(Message(input_message, MessageType.USER_INPUT))
        enter_run(self)
        result: Message | None = None
        try:
            result = self._walk(context)
            return result
        finally:
            exit_run(result)

    def _walk(self, context: Context) -> Message:
        current = self.entry_point
        assert current is not None
        for _ in range(self.max_steps):
            result = self.nodes[current](context)
            if result.message_type == MessageType.ERROR or current in self.finish_points:
                return result
            following = self.next_nodes(current, context)
            if not following:
                return result
            current = following[0]
        latest = context.get_latest_message()
        assert latest is not None
        return latest

    def describe(self) -> str:
        edges = ", ".join(f"{e.source}->{e.target}" for e in self.edges)
        routed = ", ".join(f"{s}->?" for s in self._routing)
        return f"AgentGraph({', '.join(self.nodes)}; {', '.join(x for x in (edges, routed) if x)})"


def create_simple_chain(*nodes: tuple[str, WorkflowNode]) -> AgentGraph:
    """A graph that runs `(name, node)` pairs in order."""
    graph = AgentGraph()
    for i, (name, node) in enumerate(nodes):
        graph.add_node(name, node)
        if i:
            graph.add_edge(nodes[i - 1][0], name)
    if nodes:
        graph.set_entry_point(nodes[0][0])
        graph.set_finish_point(nodes[-1][0])
    return graph
