"""The published MetaAgent-X `workflow` API, as masenvs runs it (see masenvs/mas/compat)."""

from .core import Context, Message, MessageType, ToolRegistry, WorkflowNode
from .graph import AgentGraph, Edge, create_simple_chain
from .nodes import (
    AgentNode,
    DebateNode,
    EnsembleNode,
    ReflectionNode,
    RouterNode,
    create_keyword_router,
)
from .workflow import ConditionalWorkflow, LoopWorkflow, Workflow

__version__ = "1.0.0"

__all__ = [
    "AgentGraph",
    "AgentNode",
    "ConditionalWorkflow",
    "Context",
    "DebateNode",
    "Edge",
    "EnsembleNode",
    "LoopWorkflow",
    "Message",
    "MessageType",
    "ReflectionNode",
    "RouterNode",
    "ToolRegistry",
    "Workflow",
    "WorkflowNode",
    "create_keyword_router",
    "create_simple_chain",
]
