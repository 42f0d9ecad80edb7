"""An embedded engine as a server that speaks the part of vLLM's HTTP dialect masenvs uses.

`masenvs serve --engine` serves one embedded engine with the capture endpoint's OpenAI
routes (which already return `prompt_token_ids` / `token_ids` and, on request, logprob
tokens as "token_id:<id>") plus vLLM's run-time routes: `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/collective_rpc` with masenvs' full-weight method and
`/reset_prefix_cache`. So `VLLMBackend` drives it exactly as it drives a vLLM server, and
a pool of engines (`backends/pool.py`) holds either kind. `launch_engine_server` starts
one as a subprocess and waits until `/health` answers.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from masenvs.adapters.backends.launch import VLLMProcess, free_port, launch_server
from masenvs.adapters.backends.vllm import UPDATE_METHOD
from masenvs.adapters.openai_schema import APIError
from masenvs.listeners import API_KEY_ENV, listener_key

if TYPE_CHECKING:
    from masenvs.adapters.endpoint import Endpoint

_ANY = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def engine_routes(endpoint: Endpoint) -> list[Route]:
    """vLLM's adapter and weight routes over `endpoint.backend` (an embedded engine)."""
    backend = endpoint.backend

    async def body_of(request: Request) -> dict[str, Any]:
        body = await endpoint._json_body(request)
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
        count = await asyncio.to_thread(_load_full_weights, backend, Path(str(args[0])))
        return JSONResponse({"results": [count]})

    async def reset_prefix_cache(request: Request) -> Response:
        await asyncio.to_thread(backend.reset_prefix_cache)  # type: ignore[attr-defined]
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        # The embedded engine samples a request's seed on any device; the client reads this
        # before sending seeds (VLLMBackend.seeds_honoured).
        return JSONResponse({"engine": "masenvs", "honours_seed": True})

    guard = endpoint._guard
    return [
        Route("/v1/load_lora_adapter", guard(load_lora_adapter, "POST"), methods=_ANY),
        Route("/v1/unload_lora_adapter", guard(unload_lora_adapter, "POST"), methods=_ANY),
        Route("/collective_rpc", guard(collective_rpc, "POST"), methods=_ANY),
        Route("/reset_prefix_cache", guard(reset_prefix_cache, "POST"), methods=_ANY),
        Route("/server_info", guard(server_info, "GET"), methods=_ANY),
    ]


def _load_full_weights(backend: Any, source: Path) -> int:
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


def launch_engine_server(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    dtype: str = "auto",
    quantize: str = "auto",
    batch_invariant: bool | str = False,
    max_batch_size: int = 32,
    threads: int | None = None,
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    api_key: str | None = None,
) -> VLLMProcess:
    """Start `masenvs serve --engine` on `model` and wait until `/health` answers.

    Beyond loopback it needs `api_key` (clients send it as a Bearer token); the key reaches
    the server in its environment, never on its command line."""
    key = listener_key(host, api_key, what="an engine server", key_flag="api_key=")
    port = port or free_port(host)
    args = [
        sys.executable,
        "-m",
        "masenvs.cli",
        "serve",
        "--engine",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        "--quantize",
        quantize,
        "--max-batch-size",
        str(max_batch_size),
    ]
    if threads:
        args += ["--threads", str(threads)]
    if batch_invariant:
        args += ["--batch-invariant", "auto" if batch_invariant == "auto" else "on"]
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
    )
    env = {**os.environ, **(env or {})}
    env.pop(API_KEY_ENV, None)  # a key the user set for something else must not lock it
    if key:
        env[API_KEY_ENV] = key
    url = f"http://{host}:{port}"
    return launch_server(args, env, log_file, url, timeout, f"The engine server for {model}")
