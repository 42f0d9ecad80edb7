"""An embedded engine as a server that speaks the part of vLLM's HTTP dialect masenvs uses.

`masenvs serve --engine` serves one embedded engine with the capture endpoint's OpenAI
routes (which already return `prompt_token_ids` / `token_ids` and, on request, logprob
tokens as "token_id:<id>") plus vLLM's run-time routes (`adapters/endpoint/vllm_routes.py`:
`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/collective_rpc` with masenvs'
full-weight method and `/reset_prefix_cache`). So `VLLMBackend` drives it exactly as it
drives a vLLM server, and a pool of engines (`backends/pool.py`) holds either kind.
`launch_engine_server` starts one as a subprocess and waits until `/health` answers.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from masenvs.adapters.backends.launch import VLLMProcess, free_port, launch_server
from masenvs.engine.args import EngineArgs
from masenvs.listeners import API_KEY_ENV, listener_key


def __getattr__(name: str) -> Any:
    # engine_routes moved to the endpoint package (old path: one release, with a warning).
    if name == "engine_routes":
        warnings.warn(
            "masenvs.adapters.engine_server.engine_routes moved to "
            "masenvs.adapters.endpoint.vllm_routes.engine_routes(backend, guard); import it "
            "from there (the old path goes away in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _routes_of_endpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _routes_of_endpoint(endpoint: Any) -> list[Any]:
    """The old `engine_routes(endpoint)` signature."""
    from masenvs.adapters.endpoint.vllm_routes import engine_routes

    return engine_routes(endpoint.backend, endpoint.guard)


def launch_engine_server(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    engine: EngineArgs | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    api_key: str | None = None,
    **options: Any,
) -> VLLMProcess:
    """Start `masenvs serve --engine` on `model` and wait until `/health` answers.

    The engine runs as `engine` says, with `options` (EngineArgs fields: dtype="float32",
    threads=1, ...) on top. Beyond loopback it needs `api_key` (clients send it as a Bearer
    token); the key reaches the server in its environment, never on its command line."""
    engine = dataclasses.replace(engine or EngineArgs(), **options)
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
        *engine.to_cli_args(),
    ]
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
    )
    env = {**os.environ, **(env or {})}
    env.pop(API_KEY_ENV, None)  # a key the user set for something else must not lock it
    if key:
        env[API_KEY_ENV] = key
    url = f"http://{host}:{port}"
    return launch_server(args, env, log_file, url, timeout, f"The engine server for {model}")
