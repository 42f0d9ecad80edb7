"""vLLM's run-time routes over an embedded engine, for `masenvs serve --engine`.

`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/collective_rpc` with masenvs'
full-weight method and `/reset_prefix_cache` (plus `/server_info`), so `VLLMBackend` drives
an engine server exactly as it drives a vLLM server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from masenvs.adapters.backends.vllm import UPDATE_METHOD
from masenvs.adapters.endpoint.wire import json_body, read_body
from masenvs.adapters.openai_schema import APIError

_ANY = ["GET", "POST", "PUT", "PATCH", "DELETE"]
Handler = Callable[[Request], Awaitable[Response]]


def engine_routes(backend: Any, guard: Callable[[Handler, str], Handler]) -> list[Route]:
    """vLLM's adapter and weight routes over `backend` (an embedded engine); `guard` wraps
    each handler with the endpoint's method and API key checks (`Endpoint.guard`)."""

    async def body_of(request: Request) -> dict[str, Any]:
        body = json_body(await read_body(request))
        if not isinstance(body, dict):
            raise APIError(400, "The body must be a JSON object.")
        return body

    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise APIError(400, "Give both 'lora_name' and 'lora_path'.")
        try:
            await backend.load_adapter(str(name), str(path))
        except (OSError, ValueError, KeyError) as exc:
            raise APIError(400, f"Cannot load LoRA adapter {name!r} from {path}: {exc}") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        name = str((await body_of(request)).get("lora_name") or "")
        if name not in backend.model_names()[1:]:
            raise APIError(404, f"The lora adapter '{name}' does not exist.", code="not_found")
        await asyncio.to_thread(backend.remove_adapter, name)  # type: ignore[attr-defined]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def collective_rpc(request: Request) -> Response:
        body = await body_of(request)
        if body.get("method") != UPDATE_METHOD:
            raise APIError(
                400, f"This engine runs only {UPDATE_METHOD!r}, not {body.get('method')!r}."
            )
        args = body.get("args") or []
        if len(args) != 1:
            raise APIError(400, f"{UPDATE_METHOD} takes one argument: a safetensors path.")
        count = await asyncio.to_thread(load_full_weights, backend, Path(str(args[0])))
        return JSONResponse({"results": [count]})

    async def reset_prefix_cache(request: Request) -> Response:
        await asyncio.to_thread(backend.reset_prefix_cache)  # type: ignore[attr-defined]
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        # The embedded engine samples a request's seed on any device; the client reads this
        # before sending seeds (VLLMBackend.seeds_honoured).
        return JSONResponse({"engine": "masenvs", "honours_seed": True})

    return [
        Route("/v1/load_lora_adapter", guard(load_lora_adapter, "POST"), methods=_ANY),
        Route("/v1/unload_lora_adapter", guard(unload_lora_adapter, "POST"), methods=_ANY),
        Route("/collective_rpc", guard(collective_rpc, "POST"), methods=_ANY),
        Route("/reset_prefix_cache", guard(reset_prefix_cache, "POST"), methods=_ANY),
        Route("/server_info", guard(server_info, "GET"), methods=_ANY),
    ]


def load_full_weights(backend: Any, source: Path) -> int:
    """Copy the tensors of a safetensors file or directory into the base model; their count."""
    from safetensors.torch import load_file

    files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
    if not files or not all(f.is_file() for f in files):
        raise APIError(400, f"No safetensors weights at {source}.")
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(load_file(str(file)))
    backend.set_base_weights("", weights)
    return len(weights)
