"""`masenvs serve`: serve a (trained) policy as an OpenAI-compatible API.

masenvs serve --model smollm2-135m --adapter tool=runs/x/adapters/tool --traces runs/served
masenvs serve --backend vllm --vllm-url http://127.0.0.1:8001 --host 0.0.0.0 --api-key-file key.txt
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import socket
import sys
import time
from pathlib import Path
from typing import Any

from masenvs.adapters.stack import StackError, add_model_arguments, make_backend
from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.adapter_dir import check_adapter_dir
from masenvs.engine.args import EngineArgs
from masenvs.engine.protocol import BackendError
from masenvs.listeners import (
    API_KEY_ENV,
    ListenerError,
    add_listener_arguments,
    announce,
    head_timeout_protocol,
    key_from,
    listener_key,
)
from masenvs.overrides import parse_pairs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs serve", description="Serve a policy as an OpenAI-compatible API."
    )
    add_model_arguments(
        parser,
        help=f"{DEFAULT_MODEL} (default), tiny, or a local model directory (with vllm: what "
        "`vllm serve` loads when masenvs launches it)",
    )
    parser.add_argument("--backend", choices=["embedded", "vllm"], default="embedded")
    parser.add_argument(
        "--vllm-url",
        help="URL of a running `vllm serve`; without it masenvs launches one "
        "($MASENVS_VLLM_BIN names the vllm executable)",
    )
    add_listener_arguments(parser, API_KEY_ENV)  # --api-key-file PATH or $MASENVS_API_KEY
    parser.add_argument("--traces", help="directory where every call is recorded")
    parser.add_argument(
        "--fsync",
        action="store_true",
        help="fsync each trace record (survives power loss, not only a killed process)",
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="serve the embedded engine as an engine server: vLLM's run-time routes "
        "(/v1/load_lora_adapter, /collective_rpc weight updates) on, unknown model names "
        "rejected; a pool of engines (distributed.engines) drives it like a vLLM server",
    )
    EngineArgs.add_cli_args(parser)  # --device, --threads, --max-batch-size, --dtype, ...
    parser.add_argument("--log-level", default="warning")
    return parser


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args.api_key = listener_key(
            args.host, key_from(args, API_KEY_ENV), what="the model", no_auth=args.no_auth
        )
    except ListenerError as exc:
        print(f"masenvs serve: {exc}", file=sys.stderr)
        return 2
    if args.engine and args.backend != "embedded":
        print(
            "masenvs serve: --engine serves the embedded engine; drop --backend vllm (a "
            "vLLM server already is an engine).",
            file=sys.stderr,
        )
        return 2
    try:
        adapters = parse_pairs(args.adapter, "--adapter")
        routes = parse_pairs(args.route, "--route")
        if args.backend == "embedded" or args.vllm_url is None:  # paths this machine reads
            check_adapters(adapters, routes, args.model)
    except ValueError as exc:
        print(f"masenvs serve: {exc}", file=sys.stderr)
        return 2

    launched = None
    try:
        if args.vllm_url is None:
            log(f"loading {args.model} ({args.backend})")
        backend, launched = _make_backend(args, adapters)
    except (BackendError, OSError, RuntimeError, ValueError) as exc:
        print(f"masenvs serve: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            warm(backend, adapters)
        except (BackendError, OSError, RuntimeError, ValueError) as exc:
            print(f"masenvs serve: a first call failed: {exc}", file=sys.stderr)
            return 1
        return _serve(args, backend, routes)
    finally:
        asyncio.run(backend.close())
        if launched is not None:
            launched.stop()


def log(line: str) -> None:
    """A start-up line on stderr, where a server's log goes (stdout holds the banner)."""
    print(f"masenvs serve: {line}", file=sys.stderr, flush=True)


def check_adapters(adapters: dict[str, str], routes: dict[str, str], model: str) -> None:
    """Stop (ValueError) on an `--adapter` path that holds no LoRA adapter, or a `--route`
    to an adapter no `--adapter` loads: before the model loads, not after it."""
    for name, path in adapters.items():
        try:
            check_adapter_dir(Path(path))
        except BackendError as exc:
            raise ValueError(f"--adapter {name}={path}: {exc}") from None
    served = {"base", model, Path(model).name, *adapters}
    for agent, target in routes.items():
        if target not in served:
            known = ", ".join(["base", *adapters])
            raise ValueError(
                f"--route {agent}={target} names no loaded adapter; load it with --adapter "
                f"{target}=PATH, or route {agent} to one of: {known}."
            )


def warm(backend: Any, adapters: dict[str, str]) -> None:
    """One short call to the base model and to each adapter, each logged with its time, so
    that no user's first call pays the first pass: the embedded engine packs its low-bit
    weights (tens of seconds for SmolLM2 on 2 cores) and stacks an adapter's matrices then."""
    from masenvs.engine.protocol import GenerateRequest, SamplingParams

    # Over 64 tokens, so the prefill takes the dense path a chat prompt takes, then one
    # decode step on the low-bit weights (see quant.QUANTIZED_MAX_ROWS).
    content = "Warm up: " + "one two three four five six seven eight nine ten " * 8
    for name in ["base", *adapters]:
        request = GenerateRequest(
            model=name,
            messages=[{"role": "user", "content": content}],
            params=SamplingParams(max_tokens=2, temperature=0.0),
        )
        start = time.perf_counter()
        asyncio.run(backend.generate(request))
        what = "base" if name == "base" else f"adapter {name}"
        log(f"warmed {what} in {time.perf_counter() - start:.1f} s")


def _make_backend(args: argparse.Namespace, adapters: dict[str, str]) -> tuple[Any, Any]:
    """The backend with `adapters` loaded, and the vLLM process if masenvs launched one."""
    if args.backend == "vllm":
        from masenvs.adapters.backends.vllm import VLLMBackend

        if args.vllm_url is None:  # started here, as the trainer starts its servers
            backend = VLLMBackend.launch(args.model, lora_modules=adapters)
            return backend, backend.process
        backend = VLLMBackend(args.vllm_url)
        for name, path in adapters.items():
            asyncio.run(backend.load_adapter(name, path))
        return backend, None

    try:
        backend = make_backend(args.model, engine=EngineArgs.from_cli_args(args))
    except StackError as exc:
        raise ValueError(str(exc)) from exc
    try:
        for name, path in adapters.items():
            asyncio.run(backend.load_adapter(name, path))
    except BaseException:
        backend.shutdown()  # its engine thread stops before the error is reported
        raise
    return backend, None


def _engine_line(backend: Any) -> str:
    """The embedded engine's dtype and native CPU kernel set, as a banner line."""
    forward = getattr(backend, "forward", None)
    if forward is None:  # not the embedded engine
        return ""
    from masenvs.engine import kernels as cpu_kernels

    kernels = cpu_kernels.kernel_set() if forward.native else None
    dtype = str(forward.dtype).removeprefix("torch.")
    return f"  engine: {dtype}, native CPU kernels {kernels or 'off (torch paths)'}\n"


def _serve(args: argparse.Namespace, backend: Any, routes: dict[str, str]) -> int:
    import uvicorn

    from masenvs.adapters.endpoint import create_app
    from masenvs.adapters.policy_map import PolicyMap
    from masenvs.traces import TraceStore

    store = (
        TraceStore(args.traces, durability="fsync" if args.fsync else "flush")
        if args.traces
        else None
    )
    reject = args.unknown_agents == "reject" or args.engine  # an engine never falls back
    policy_map = PolicyMap(
        routes,
        default=None if reject else "base",
        reject_hint="; ask for one of those, or start the server with --route NAME=ADAPTER "
        "or --unknown-agents base (the base model answers any name)",
    )
    app = create_app(
        backend, store=store, policy_map=policy_map, api_key=args.api_key, engine=args.engine
    )
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only for sockets
    # whose proto says TCP; without it each JSON response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"masenvs serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    sock.listen(2048)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    root = f"http://{host}:{port}"
    model = backend.model_names()[0]
    # The snippet asks for what a user came for: a trained adapter (or a route) when loaded.
    asked = next(iter([*routes, *(m for m in app.model_ids() if m not in (model, "base"))]), model)
    # The snippet names where the key is, never the key: a banner lands in logs and scrollback.
    if not args.api_key:
        key = '"unused"'
    elif args.api_key_file:
        key = f"open({args.api_key_file!r}).read().strip()"
    else:
        key = f"os.environ[{API_KEY_ENV!r}]"
    print(
        f"masenvs serve: {model} ({args.backend}) at {root}/v1\n"
        f"  models: {', '.join(app.model_ids())}\n"
        f"{_engine_line(backend)}"
        f"  traces: {args.traces or 'off'}; rollouts: {root}/r/<rollout_id>/v1\n"
        f"  {announce('engine server' if args.engine else 'serve', root, args.api_key)}\n"
        "  call it with the openai client:\n"
        f"    {'import os; ' if 'os.environ' in key else ''}from openai import OpenAI\n"
        f"    client = OpenAI(base_url='{root}/v1', api_key={key})\n"
        f"    client.chat.completions.create(model='{asked}', "
        "messages=[{'role': 'user', 'content': 'Hello'}])",
        flush=True,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        lifespan="off",
        access_log=False,
        http=head_timeout_protocol(),  # a connection that sends no request is closed
    )
    uvicorn.Server(config).run(sockets=[sock])
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
