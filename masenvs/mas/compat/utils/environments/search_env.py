"""SearchEnvironment: web search is not reachable from a design (no network); its tools
answer so, and the agent goes on without them."""

from __future__ import annotations

from typing import Any

OFFLINE = "Search is not available here: designs run without network. Answer without it."


class SearchEnvironment:
    def __init__(self, serper_key: str | None = None, **kwargs: Any) -> None:
        self.serper_key = serper_key

    def search(self, query: str = "", **kwargs: Any) -> str:
        return OFFLINE

    def fetch(self, url: str = "", **kwargs: Any) -> str:
        return OFFLINE
