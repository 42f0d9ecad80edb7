"""The API's core: messages, the run context, the node base class and the tool registry.

Also what the design runner reads back: the last top-level run's result and the graph of
the agents that ran (`last_result`, `design_graph`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from masenvs.mas.llm import BudgetExceeded


class MessageType(Enum):
    USER_INPUT = "user_input"
    AGENT_RESPONSE = "agent_response"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    INTERMEDIATE = "intermediate"
    FINAL_RESULT = "final_result"
    ERROR = "error"


@dataclass
class Message:
    """What flows between nodes: content, its kind, who sent it."""

    content: Any
    message_type: MessageType
    metadata: dict[str, Any] = field(default_factory=dict)
    sender: str | None = None
    recipient: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "type": self.message_type.value,
            "metadata": self.metadata,
            "sender": self.sender,
            "recipient": self.recipient,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        return cls(
            data["content"],
            MessageType(data["type"]),
            dict(data.get("metadata") or {}),
            data.get("sender"),
            data.get("recipient"),
        )


@dataclass
class Context:
    """One run's history of messages and its shared state."""

    messages: list[Message] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def add_message(self, message: Message) -> None:
        self.messages.append(message)

    def get_messages_by_type(self, message_type: MessageType) -> list[Message]:
        return [m for m in self.messages if m.message_type == message_type]

    def get_latest_message(self, message_type: MessageType | None = None) -> Message | None:
        for m in reversed(self.messages):
            if message_type is None or m.message_type == message_type:
                return m
        return None

    def set_state(self, key: str, value: Any) -> None:
        self.state[key] = value

    def get_state(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    def question(self) -> str:
        """The run's first user input as text (the original question)."""
        first = next((m for m in self.messages if m.message_type == MessageType.USER_INPUT), None)
        first = first or self.get_latest_message()
        return "" if first is None else as_text(first.content)


def as_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        import json

        return json.dumps(content, ensure_ascii=False, default=str)
    return str(content)


class WorkflowNode(ABC):
    """A unit of a workflow. Calling it runs `process`, names the result's sender and adds
    it to the context; an exception becomes an ERROR message (the LLM budget excepted: a
    design over its budget fails as a whole)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a node needs a non-empty name, got {name!r}")
        self.name = name
        self.config = kwargs
        # No handler: a design's log lines would eat into its output limit.
        self.logger = logging.getLogger(f"workflow.{type(self).__name__}.{name}")

    @abstractmethod
    def process(self, context: Context) -> Message: ...

    def __call__(self, context: Context) -> Message:
        try:
            result = self.process(context)
            if not isinstance(result, Message):
                result = Message(result, MessageType.AGENT_RESPONSE)
        except BudgetExceeded:
            raise
        except Exception as exc:
            result = Message(
                {"error": str(exc), "node": self.name},
                MessageType.ERROR,
                {"exception_type": type(exc).__name__},
            )
        result.sender = self.name
        context.add_message(result)
        return result

    def describe(self) -> str:
        """The node as a structure string (the design graph's `structure`)."""
        return self.name


class ToolRegistry:
    """Tools an AgentNode may call: name -> function, with a description and JSON schema."""

    def __init__(self) -> None:
        self._tools: dict[str, dict[str, Any]] = {}

    def register(
        self,
        name: str,
        func: Callable[..., Any],
        description: str = "",
        parameters: dict[str, Any] | None = None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"tool {name!r} must be callable, got {type(func).__name__}")
        self._tools[name] = {
            "function": func,
            "description": description,
            "parameters": parameters or {"type": "object", "properties": {}},
        }

    def get_tool(self, name: str) -> dict[str, Any] | None:
        return self._tools.get(name)

    def list_tools(self) -> list[str]:
        return list(self._tools)

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": tool["description"],
                    "parameters": tool["parameters"],
                },
            }
            for name, tool in self._tools.items()
        ]

    def call_tool(self, name: str, parameters: dict[str, Any]) -> Any:
        tool = self.get_tool(name)
        if tool is None:
            raise ValueError(f"Tool '{name}' not found")
        return tool["function"](**parameters)


# --- what the design runner reads back -----------------------------------------------------

_runs: list[Message] = []  # the final message of each top-level run
_depth = [0]  # runs in progress (a workflow run inside a node is not top-level)
_agents: dict[str, str] = {}  # AgentNode name -> system prompt, in creation order
_order: list[str] = []  # AgentNode names in the order they ran
_top: list[Any] = []  # the top-level workflows that ran


def reset() -> None:
    _runs.clear()
    _depth[0] = 0
    _agents.clear()
    _order.clear()
    _top.clear()


def enter_run(workflow: Any) -> None:
    if _depth[0] == 0:
        _top.append(workflow)
    _depth[0] += 1


def exit_run(result: Message | None) -> None:
    _depth[0] -= 1
    if _depth[0] == 0 and result is not None:
        _runs.append(result)


def last_result() -> Message | None:
    return _runs[-1] if _runs else None


def agent_created(name: str, system_prompt: str) -> None:
    _agents.setdefault(name, system_prompt)


def agent_ran(name: str) -> None:
    _order.append(name)


def design_graph(calls: dict[str, list[str]]) -> dict[str, Any] | None:
    """The executed design as a DesignGraph dict: the agents that were created, edges in the
    order agents ran, the top-level workflow's structure."""
    from masenvs.mas.graph import DesignGraph, Node

    if not _agents and not calls:
        return None
    names = list(dict.fromkeys([*_agents, *calls]))
    nodes = [Node(n, _agents.get(n, "")[:500], list(calls.get(n, []))) for n in names]
    edges = list(dict.fromkeys((a, b) for a, b in zip(_order, _order[1:]) if a != b))
    structure = ", ".join(getattr(w, "describe", lambda: "workflow")() for w in _top)
    return DesignGraph(structure or "workflow (not run)", nodes, edges).to_dict()


def callback_failed(what: str) -> None:
    """A design's routing or condition function raised: the workflow goes on as the
    published API does (no route, stop the loop), and the traceback reaches the design's
    stderr so its author sees why."""
    import sys
    import traceback

    print(f"workflow: {what} raised; going on without it:", file=sys.stderr)
    traceback.print_exc()
