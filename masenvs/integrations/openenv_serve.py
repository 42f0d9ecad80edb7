"""`masenvs openenv-serve ENV`: a masenvs env as an OpenEnv environment server (openenv.py).

The env, its options, the role and the key are checked before openenv-core is imported (it
takes seconds to import), so a typo fails at once, in one line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from masenvs.integrations.episode import TextEpisode, openai_player
from masenvs.listeners import (
    API_KEY_ENV,
    ListenerError,
    add_listener_arguments,
    announce,
    key_from,
    listener_key,
)
from masenvs.memory import tune_allocator
from masenvs.overrides import parse_overrides

MAX_MESSAGE_BYTES = 1 << 20  # one request or WebSocket message (openenv.py's default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs openenv-serve",
        description="Serve a masenvs env as an OpenEnv environment server: the openenv-core "
        "client (and trainers built on it) reset, step and read the state of isolated sessions.",
    )
    parser.add_argument("env", help="environment name (see `masenvs list`)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="env config field"
    )
    parser.add_argument(
        "--role", help="the one role the client plays (default: every role, in turn order)"
    )
    parser.add_argument(
        "--others-url",
        metavar="URL",
        help="OpenAI-compatible base URL (e.g. `masenvs serve`'s .../v1) that plays the other "
        "roles when --role is given; its key, if it needs one, from $OPENAI_API_KEY",
    )
    parser.add_argument(
        "--others-model", help="model name sent to --others-url (default: the role's name)"
    )
    add_listener_arguments(parser, API_KEY_ENV)  # --api-key-file PATH or $MASENVS_API_KEY
    parser.add_argument(
        "--max-sessions", type=int, default=256, help="concurrent sessions (default: 256)"
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=600.0,
        help="seconds after which a silent session is closed (default: 600)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="largest request body or WebSocket message (default: 1 MiB)",
    )
    parser.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)

    def fail(message: str) -> int:
        print(f"masenvs openenv-serve: {message}", file=sys.stderr)
        return 2

    try:
        api_key = listener_key(
            args.host, key_from(args, API_KEY_ENV), what="the env server", no_auth=args.no_auth
        )
    except ListenerError as exc:
        return fail(str(exc))
    if args.others_url and not args.role:
        return fail("--others-url plays the roles other than --role: give --role ROLE too")
    if min(args.max_sessions, args.max_message_bytes) < 1 or args.idle_timeout <= 0:
        return fail("--max-sessions, --max-message-bytes and --idle-timeout must be positive")
    others = None
    if args.others_url:
        key = os.environ.get("OPENAI_API_KEY")
        others = openai_player(args.others_url, model=args.others_model, api_key=key)
    options = parse_overrides(args.set)
    try:
        TextEpisode(args.env, options, role=args.role, others=others)
    except (KeyError, ValueError) as exc:
        message = str(exc)
        if "needs a player for" in message:
            message += " (on the command line: --others-url URL)"
        return fail(message)

    try:
        from masenvs.integrations.openenv import create_server, uvicorn_config
    except ImportError as exc:
        return fail(
            f"needs openenv-core ({exc.name} is missing): pip install 'masenvs[integrations]'"
        )

    app = create_server(
        args.env,
        options,
        role=args.role,
        others=others,
        api_key=api_key,
        max_sessions=args.max_sessions,
        idle_timeout=args.idle_timeout,
        max_message_bytes=args.max_message_bytes,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        return fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    sock.listen(256)  # connections queue from now on: the printed address answers at once
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    who = f"role {args.role!r}, others from {args.others_url}" if args.role else "every role"
    # The snippet says where the key goes, never the key: a banner lands in logs.
    client_url = url.replace("://", "://masenvs:<key>@") if api_key else url
    print(
        f"masenvs openenv-serve: {args.env} at {url} ({who}; OpenEnv sessions at {url}/ws)\n"
        f"  {announce('OpenEnv env server', url, api_key)}\n"
        "  from openenv.core import GenericEnvClient\n"
        f"  env = GenericEnvClient(base_url='{client_url}').sync()\n"
        "  env.reset(seed=0); env.step({'message': '...'}); env.state()",
        flush=True,
    )
    import uvicorn

    # Up to max_sessions messages of max_message_bytes are in flight at once. With glibc's own
    # settings each burst left 80-170 MB more resident than the last, varying with the load
    # (freed messages raise the mmap threshold and stay in the heap arenas); fixed settings
    # give every message its own mapping, returned when it is freed (docs/openenv.md).
    tune_allocator()
    uvicorn.Server(uvicorn_config(app, args.log_level)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
