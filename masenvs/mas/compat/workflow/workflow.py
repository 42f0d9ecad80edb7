"""Workflows: nodes in a row, nodes with conditions, nodes in a loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from masenvs.mas.llm import current_harness

from .core import (
    Context,
    Message,
    MessageType,
    WorkflowNode,
    callback_failed,
    enter_run,
    exit_run,
)


class Workflow:
    """Nodes run in order on one shared context; the first ERROR stops the run. The
    verl-era arguments (`ai_client`, `tokenizer`, ...) are accepted and unused: every
    node's calls go to the design's executor."""

    # The published Workflow.run puts the workflow in the run's context, where its
    # AgentNodes find their client; its ConditionalWorkflow and LoopWorkflow do not
    # (workflow.py:111 vs 206-260, 295-355 there), so under that harness their nodes fail.
    shares_itself = True

    def __init__(
        self,
        name: str = "workflow",
        ai_client: Any = None,
        tokenizer: Any = None,
        server_address: str | None = None,
        ppo_trainer_config: Any = None,
        enable_thinking: bool = False,
    ) -> None:
        self.name = name
        self.nodes: list[WorkflowNode] = []
        self.ai_client, self.tokenizer, self.server_address = ai_client, tokenizer, server_address
        self.ppo_trainer_config, self.enable_thinking = ppo_trainer_config, enable_thinking
        self.dataproto_list: list[Any] = []  # the calls are in the trace store instead

    def add_node(self, node: WorkflowNode) -> Workflow:
        self.nodes.append(_node(node))
        return self

    def add_nodes(self, nodes: list[WorkflowNode]) -> Workflow:
        for node in nodes:
            self.add_node(node)
        return self

    def run(self, input_message: Any, initial_state: dict[str, Any] | None = None) -> Message:
        context = Context(state=dict(initial_state or {}))
        if self.shares_itself or current_harness() != "published":
            context.state["workflow"] = self
        context.add_message(Message(input_message, MessageType.USER_INPUT))
        return self.run_with_context(context)

    def run_with_context(self, context: Context) -> Message:
        enter_run(self)
        result: Message | None = None
        try:
            result = self._execute(context)
            return result
        finally:
            exit_run(result)

    def _execute(self, context: Context) -> Message:
        for node in self.nodes:
            result = node(context)
            if result.message_type == MessageType.ERROR:
                return result
        return _latest(context)

    def describe(self) -> str:
        return f"{type(self).__name__}({', '.join(n.describe() for n in self.nodes)})"


class ConditionalWorkflow(Workflow):
    """A node runs only when its condition (a function of the context) holds; a condition
    that raises counts as false."""

    shares_itself = False

    def __init__(self, name: str = "conditional_workflow", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.conditions: list[Callable[[Context], bool] | None] = []

    def add_node(
        self, node: WorkflowNode, condition: Callable[[Context], bool] | None = None
    ) -> ConditionalWorkflow:
        self.nodes.append(_node(node))
        self.conditions.append(condition)
        return self

    def _execute(self, context: Context) -> Message:
        for node, condition in zip(self.nodes, self.conditions):
            if condition is not None:
                try:
                    if not condition(context):
                        continue
                except Exception:
                    callback_failed("a node's condition")
                    continue
            result = node(context)
            if result.message_type == MessageType.ERROR:
                return result
        return _latest(context)


class LoopWorkflow(Workflow):
    """All nodes run, in order, again and again while the loop condition holds, at most
    `max_iterations` times."""

    shares_itself = False

    def __init__(self, name: str = "loop_workflow", max_iterations: int = 10, **kwargs: Any):
        super().__init__(name, **kwargs)
        if not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"max_iterations must be an integer >= 1, got {max_iterations!r}")
        self.max_iterations = max_iterations
        self.loop_condition: Callable[[Context], bool] | None = None

    def set_loop_condition(self, condition: Callable[[Context], bool]) -> LoopWorkflow:
        self.loop_condition = condition
        return self

    def run(self, input_message: Any, initial_state: dict[str, Any] | None = None) -> Message:
        if self.loop_condition is None:
            raise ValueError("Loop condition must be set before running LoopWorkflow")
        return super().run(input_message, initial_state)

    def _execute(self, context: Context) -> Message:
        for _ in range(self.max_iterations):
            for node in self.nodes:
                result = node(context)
                if result.message_type == MessageType.ERROR:
                    return result
            try:
                if not self.loop_condition(context):  # type: ignore[misc]
                    break
            except Exception:
                callback_failed("the loop condition")
                break
        return _latest(context)

    def describe(self) -> str:
        inner = ", ".join(n.describe() for n in self.nodes)
        return f"LoopWorkflow({inner}, max={self.max_iterations})"


def _node(node: Any) -> WorkflowNode:
    if not isinstance(node, WorkflowNode):
        raise TypeError(f"a workflow takes nodes (AgentNode, ...), got {type(node).__name__}")
    return node


def _latest(context: Context) -> Message:
    latest = context.get_latest_message()
    assert latest is not None  # the run's input is always there
    return latest
