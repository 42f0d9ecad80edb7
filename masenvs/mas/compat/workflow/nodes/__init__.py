"""The API's node types."""

from .agent_node import AgentNode
from .debate_node import DebateNode
from .ensemble_node import EnsembleNode
from .reflection_node import ReflectionNode
from .router_node import RouterNode, create_keyword_router

__all__ = [
    "AgentNode",
    "DebateNode",
    "EnsembleNode",
    "ReflectionNode",
    "RouterNode",
    "create_keyword_router",
]
