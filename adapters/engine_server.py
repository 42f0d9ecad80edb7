"""Deprecated: the engine server's parts moved (this path goes away in the next release).

`launch_engine_server` is in masenvs.adapters.backends.launch; the vLLM routes an engine
server adds (`engine_routes`) are in masenvs.adapters.endpoint.vllm_routes.
"""

from __future__ import annotations

import warnings
from typing import Any

from masenvs.adapters.backends.launch import launch_engine_server
from masenvs.adapters.endpoint.vllm_routes import engine_routes as _engine_routes

warnings.warn(
    "masenvs.adapters.engine_server moved: import launch_engine_server from "
    "masenvs.adapters.backends.launch and engine_routes from "
    "masenvs.adapters.endpoint.vllm_routes",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["engine_routes", "launch_engine_server"]


def engine_routes(endpoint: Any) -> list[Any]:
    """The old `engine_routes(endpoint)`: vLLM's routes over `endpoint.backend`."""
    return _engine_routes(endpoint.backend, endpoint.guard)
