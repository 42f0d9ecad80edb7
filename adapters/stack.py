"""A backend, the capture endpoint and a trace store, started together in this process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from masenvs import overrides
from masenvs.adapters.endpoint import Endpoint, EndpointServer, create_app
from masenvs.adapters.policy_map import PolicyMap
from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.args import EngineArgs
from masenvs.engine.protocol import Backend, BackendError
from masenvs.registry import env_class
from masenvs.traces import TraceStore


class StackError(Exception):
    """The stack could not start; the message names the cause and the fix."""


@dataclass
class Stack:
    backend: Backend
    endpoint: Endpoint
    server: EndpointServer
    store: TraceStore | None
    api_key: str | None = None

    @property
    def root_url(self) -> str:
        """The server's root, `http://host:port`; rollouts call `{root_url}/r/{id}/v1`."""
        return self.server.url

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, `http://host:port/v1` (as everywhere in masenvs)."""
        return self.server.base_url

    def close(self) -> None:
        self.server.stop()
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
        else:
            asyncio.run(self.backend.close())
        if self.store is not None:
            self.store.close()


def with_endpoint(
    env_name: str, options: dict[str, Any], root_url: str, api_key: str | None
) -> dict[str, Any]:
    """`options` for an env that calls the model itself (auto-MAS's executor), pointed at the
    endpoint at `root_url` with `api_key`, unless they already name one; others unchanged."""
    fields = env_class(env_name).config_class.model_fields
    if "endpoint_url" not in fields or options.get("endpoint_url"):
        return options
    out = {**options, "endpoint_url": root_url}
    if "endpoint_api_key" in fields and api_key:
        out.setdefault("endpoint_api_key", api_key)
    return out


def parse_pairs(pairs: list[str], flag: str) -> dict[str, str]:
    """`NAME=VALUE` command-line pairs as a dict; a malformed one stops the command."""
    try:
        return overrides.parse_pairs(pairs, flag)
    except overrides.ConfigError as exc:
        raise SystemExit(str(exc)) from None


# The engine flags `masenvs rollout` and `masenvs eval` take (serve takes every EngineArgs flag).
ENGINE_FLAGS = ["dtype", "quantize", "batch_invariant"]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype, --quantize and --batch-invariant, as `EngineArgs` declares them."""
    EngineArgs.add_cli_args(parser, ENGINE_FLAGS)


def add_model_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    default: str | None = DEFAULT_MODEL,
    help: str | None = None,
    routes: bool = True,
) -> None:
    """The model flags every command shares, declared once: --model, and with `routes` the
    policy flags of the commands that serve one (--adapter NAME=PATH, --route AGENT=ADAPTER,
    --unknown-agents)."""
    parser.add_argument(
        "--model",
        default=default,
        help=help or f"{DEFAULT_MODEL} (default), tiny, or a local model directory",
    )
    if not routes:
        return
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load a peft LoRA adapter under NAME (repeatable); requests select it with model=NAME",
    )
    parser.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="AGENT=ADAPTER",
        help="send requests for model=AGENT to ADAPTER (repeatable)",
    )
    parser.add_argument(
        "--unknown-agents",
        choices=["reject", "base"],
        default="reject",
        help="what a model name that is neither a route, an adapter nor the base model gets: "
        "404 naming the known models (reject, the default, in every command) or the base "
        "model (base)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineArgs` fields the flags of `add_engine_arguments` set, by name."""
    engine = EngineArgs.from_cli_args(args)
    return {name: getattr(engine, name) for name in ENGINE_FLAGS}


def make_backend(
    model: str = DEFAULT_MODEL,
    backend: str = "embedded",
    vllm_url: str | None = None,
    engine: EngineArgs | None = None,
    **options: Any,
) -> Backend:
    """A client of the vLLM server at `vllm_url`, or the embedded engine on `model`, built
    from `engine` with `options` (`EngineArgs` fields) on top."""
    if backend == "vllm":
        from masenvs.adapters.backends.vllm import VLLMBackend

        if not vllm_url:
            raise StackError("--backend vllm needs --vllm-url (the URL of a running `vllm serve`)")
        return VLLMBackend(vllm_url)
    if backend != "embedded":
        raise StackError(f"unknown backend {backend!r}: use 'embedded' or 'vllm'")
    from masenvs.engine.engine import EmbeddedBackend
    from masenvs.engine.loading import ModelLoadError

    try:
        args = dataclasses.replace(engine or EngineArgs(), **options)
        return EmbeddedBackend.from_args(model, args)
    except (ModelLoadError, BackendError) as exc:
        raise StackError(str(exc)) from exc


def start_stack(
    *,
    model: str = DEFAULT_MODEL,
    backend: str | Backend = "embedded",
    vllm_url: str | None = None,
    traces: str | Path | None = None,
    adapters: dict[str, str] | None = None,
    policy_map: dict[str, str] | PolicyMap | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    **engine: Any,
) -> Stack:
    """Load the backend, load `adapters` (name -> peft dir), serve the endpoint on `host`."""
    served = (
        backend
        if not isinstance(backend, str)
        else make_backend(model, backend, vllm_url, **engine)
    )
    for name, path in (adapters or {}).items():
        try:
            asyncio.run(served.load_adapter(name, str(path)))
        except (BackendError, OSError, ValueError) as exc:
            raise StackError(f"could not load adapter {name} from {path}: {exc}") from exc
    store = TraceStore(traces) if traces is not None else None
    if isinstance(policy_map, dict):
        policy_map = PolicyMap(policy_map)
    endpoint = create_app(served, store=store, policy_map=policy_map, api_key=api_key)
    server = EndpointServer(endpoint, host=host, port=port)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        raise StackError(f"the endpoint could not listen on {host}:{port}: {exc}") from exc
    return Stack(served, endpoint, server, store, api_key)
