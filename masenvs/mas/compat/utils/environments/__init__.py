"""Tool environments a design's AgentNodes register: Python (math_env) and search."""

from .math_env import MathEnvironment, python_execute
from .search_env import SearchEnvironment

__all__ = ["MathEnvironment", "SearchEnvironment", "python_execute"]
