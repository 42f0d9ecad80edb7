"""RouterNode: a function of the context picks which node handles it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import Context, Message, WorkflowNode, as_text, callback_failed


class RouterNode(WorkflowNode):
    """`routing_func(context)` names one of `routes`; an unknown name or an error in it
    falls back to `default_route`."""

    def __init__(
        self,
        name: str,
        routes: dict[str, WorkflowNode],
        routing_func: Callable[[Context], str],
        default_route: str = "default",
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        if not isinstance(routes, dict) or not routes:
            raise ValueError("RouterNode needs a non-empty dict of routes")
        if default_route not in routes:
            raise ValueError(f"Default route '{default_route}' not found in routes")
        self.routes, self.routing_func, self.default_route = (
            dict(routes),
            routing_func,
            default_route,
        )

    def process(self, context: Context) -> Message:
        try:
            route = self.routing_func(context)
        except Exception:
            callback_failed(f"router {self.name!r}'s routing function")
            route = self.default_route
        if route not in self.routes:
            route = self.default_route
        result = self.routes[route](context)
        result.metadata["routed_from"] = self.name
        result.metadata["route_taken"] = route
        return result

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v.describe()}" for k, v in self.routes.items())
        return f"RouterNode({inner})"


def create_keyword_router(
    name: str,
    keyword_routes: dict[str, WorkflowNode],
    default_node: WorkflowNode,
    case_sensitive: bool = False,
) -> RouterNode:
    """A router that takes the first keyword found in the latest message."""

    def route(context: Context) -> str:
        latest = context.get_latest_message()
        text = as_text(latest.content) if latest is not None else ""
        text = text if case_sensitive else text.lower()
        for keyword in keyword_routes:
            if (keyword if case_sensitive else keyword.lower()) in text:
                return keyword
        return "default"

    return RouterNode(name, {**keyword_routes, "default": default_node}, route, "default")
