"""One endpoint in front of several backends: each model name is served by its own backend.

AT-GRPO's `separate` mode trains agents on different base models, and full fine-tuning
per agent gives each agent its own weights; an inference engine or a vLLM server serves one
base model.
`RouterBackend` maps each name a request may carry (the agent's policy) to a `Route`: the
backend that serves it and the name it has there (an adapter, or "" for that backend's
base model), so the endpoint, the policy map and the trainer's weight sync stay unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from masenvs.engine.protocol import (
    Backend,
    BackendError,
    GenerateRequest,
    Generation,
    StreamDelta,
    honours_seed,
)

BASE_NAMES = ("", "base")


@dataclass(frozen=True)
class Route:
    """Where a name is served: `backend`, under `model` there ("" = its base model)."""

    backend: Backend
    model: str = ""


class RouterBackend:
    """Serves `routes[name]` for requests whose model is `name`; "" / "base" go to the first.

    All backends must share a tokenizer: token ids, the endpoint's token texts and the
    traces' tokenizer id are per endpoint.
    """

    def __init__(self, routes: Mapping[str, Route]) -> None:
        if not routes:
            raise BackendError("A router needs at least one route.")
        self.routes = dict(routes)
        self.backends: list[Backend] = list(
            {id(r.backend): r.backend for r in routes.values()}.values()
        )
        ids = {b.tokenizer_id() for b in self.backends}
        if len(ids) > 1:
            raise BackendError(
                f"The routed models use {len(ids)} different tokenizers; one endpoint serves "
                "one tokenizer. Use base models of one family (one tokenizer) per run."
            )
        self.default = next(iter(self.routes))  # where "" / "base" go
        # Traces name the backend that sampled ("vllm", an engine's model), not a route.
        names = {getattr(b, "name", type(b).__name__) for b in self.backends}
        self.name = "+".join(sorted(names))
        self.chat_template = getattr(self.backends[0], "chat_template", None)

    def route(self, model: str) -> Route:
        """The route of `model`; a 404 `BackendError` names the served names if none."""
        if model in BASE_NAMES:
            return Route(self.routes[self.default].backend, "")
        route = self.routes.get(model)
        if route is None:
            raise BackendError(
                f"The model {model!r} does not exist; this router serves {sorted(self.routes)}.",
                404,
                "model_not_found",
            )
        return route

    def _forward(self, request: GenerateRequest) -> tuple[Route, GenerateRequest]:
        route = self.route(request.model)
        return route, dataclasses.replace(request, model=route.model)

    # ---- Backend protocol ----------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        route, routed = self._forward(request)
        generation = await route.backend.generate(routed)
        return dataclasses.replace(generation, model=request.model or generation.model)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        route, routed = self._forward(request)
        async for item in route.backend.stream(routed):
            if isinstance(item, Generation):
                item = dataclasses.replace(item, model=request.model or item.model)
            yield item

    def model_names(self) -> list[str]:
        return list(self.routes)

    @property
    def honours_seed(self) -> bool:
        """Whether every routed backend samples a request's seed (base.honours_seed)."""
        return all(honours_seed(b) for b in self.backends)

    def decode(self, token_ids: list[int]) -> str:
        return self.backends[0].decode(token_ids)

    def tokenizer_id(self) -> str:
        return self.backends[0].tokenizer_id()

    async def load_adapter(self, name: str, path: str) -> None:
        route = self.route(name)
        await route.backend.load_adapter(route.model or name, path)

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends))

    def end_rollout(self, rollout_id: str) -> None:
        """Tell pools of engines behind the router that `rollout_id` ended."""
        for backend in self.backends:
            getattr(backend, "end_rollout", lambda _: None)(rollout_id)

    # ---- in-place weight updates (the trainer's sync), forwarded by name --------------------

    def add_adapter(self, name: str, state_dict: Mapping[str, Tensor], **lora: Any) -> None:
        route = self.route(name)
        self._method(route, "add_adapter")(route.model or name, state_dict, **lora)

    def set_adapter_weights(self, name: str, state_dict: Mapping[str, Tensor]) -> None:
        route = self.route(name)
        self._method(route, "set_adapter_weights")(route.model or name, state_dict)

    def set_base_weights(self, name: str, state_dict: Mapping[str, Tensor]) -> None:
        """New weights for the base model that serves `name` (full fine-tuning)."""
        route = self.route(name)
        if route.model:
            raise BackendError(f"{name!r} is served by adapter {route.model!r}, not a base model.")
        self._method(route, "set_base_weights")("", state_dict)

    def shutdown(self) -> None:
        for backend in self.backends:
            shutdown = getattr(backend, "shutdown", None)
            if shutdown is not None:
                shutdown()
            else:
                asyncio.run(backend.close())

    @staticmethod
    def _method(route: Route, name: str) -> Any:
        method = getattr(route.backend, name, None)
        if method is None:
            raise BackendError(f"{type(route.backend).__name__} has no {name}.", 501)
        return method
