"""The rules every masenvs listener follows: a key beyond loopback and never on screen,
request bodies bounded in bytes and in what they parse into (request_bodies.py), connections
no idle client can use up.

A port bound to anything but loopback needs an API key: `listener_key` gives the key to
use (the one given, a generated one, or None on loopback) or refuses to start; only an
explicit open flag skips it, with a warning. Keys come from the environment or a file
(`add_key_arguments`, `key_from`), never from argv (where `ps` shows them), and are never
printed or logged: `announce` says only "key: set", `scrub_keys` masks `key=` in access
logs. `ConnectionCap` (threaded servers) and `head_timeout_protocol` (uvicorn) close
connections that have not sent a request, after a timeout or as soon as a new connection
needs the room, so idle or trickling clients cannot lock others out; `CappedHandler.read_json`
reads a body by the rules of request_bodies.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from masenvs.request_bodies import JsonLimits, read_json_body

# The environment variables keys come from, one per kind of server (a key for one must not
# open another): masenvs's own model servers (`serve`, its engine servers, the trainer's
# endpoint, `ui`, `openenv-serve`; `rollout --url` sends it) ...
API_KEY_ENV = "MASENVS_API_KEY"
# ... `search-serve`, whose key the search envs' HttpBackend sends ...
SEARCH_API_KEY_ENV = "MASENVS_SEARCH_API_KEY"
# ... and engine servers the trainer is given by URL (`distributed.engines.urls`).
ENGINES_API_KEY_ENV = "MASENVS_ENGINES_API_KEY"
HEAD_TIMEOUT = 10.0  # seconds a new connection to a uvicorn listener has to send its request head


class ListenerError(ValueError):
    """A listener would leave loopback with no key; the message says how to fix it."""


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (a host name other than localhost is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def listener_key(
    host: str,
    api_key: str | None,
    *,
    what: str,
    no_auth: bool = False,
    generate: bool = False,
    key_flag: str = f"--api-key-file PATH (or set ${API_KEY_ENV})",
    open_flag: str = "--no-auth",
) -> str | None:
    """The key `what` listening on `host` requires: `api_key` if given; on loopback None;
    beyond it a generated one (`generate`), None with a warning (`no_auth`), else refused."""
    if api_key:
        return api_key
    if is_loopback(host):
        return None
    if no_auth:
        print(
            f"WARNING: {what} listens on {host} with NO API key ({open_flag}): anyone who can "
            "reach this port can use it.",
            file=sys.stderr,
            flush=True,
        )
        return None
    if generate:
        return secrets.token_urlsafe(32)
    raise ListenerError(
        f"refusing to listen on {host} without an API key: anyone who can reach this "
        f"machine could use {what}. Give {key_flag}, bind to 127.0.0.1, or pass {open_flag} "
        "to serve it open on purpose."
    )


# -- keys: from the environment or a file, never argv, never printed ----------------------------


def add_key_arguments(
    parser: Any,
    env: str = API_KEY_ENV,
    what: str = "the key clients send as 'Authorization: Bearer KEY'",
    required: str = "; required when --host is not a loopback address",
) -> None:
    """`--api-key-file PATH`, and an `--api-key` that only refuses (`key_from` says why);
    `parser` is an ArgumentParser or one of its groups."""
    parser.add_argument(
        "--api-key-file", metavar="PATH", help=f"file holding {what} (default: ${env}){required}"
    )
    # Kept only to refuse: without it argparse would take `--api-key X` as an abbreviation
    # of --api-key-file and read a file named by the key.
    parser.add_argument(
        "--api-key", dest="api_key_argv", nargs="?", const="", help=argparse.SUPPRESS
    )


def add_listener_arguments(
    parser: Any, env: str = API_KEY_ENV, port: int = 8000, no_auth: bool = True
) -> None:
    """The flags every masenvs server takes: `--host` (loopback by default), `--port`, the key
    (`add_key_arguments`) and, where a server may listen openly, `--no-auth`."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port, help="0 picks a free port")
    add_key_arguments(parser, env)
    if no_auth:
        parser.add_argument(
            "--no-auth",
            action="store_true",
            help="listen beyond loopback with no API key anyway (prints a warning)",
        )


def key_from(args: argparse.Namespace, env: str = API_KEY_ENV) -> str | None:
    """The key of `add_key_arguments`' flags: the file's (stripped), else $`env`, else None;
    ListenerError for a key on the command line or a file that cannot be read."""
    if getattr(args, "api_key_argv", None) is not None:
        raise ListenerError(
            "--api-key puts the key on the command line, where `ps` shows it to every user "
            f"of this machine: write it to a file and give --api-key-file PATH, or set ${env}."
        )
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ListenerError(
                f"cannot read the API key from {args.api_key_file} ({exc}); give "
                "--api-key-file a readable file holding only the key."
            ) from None
        if not key:
            raise ListenerError(f"{args.api_key_file} is empty: write the API key into it.")
        return key
    return os.environ.get(env) or None


def announce(what: str, url: str, api_key: str | None) -> str:
    """The startup line naming a listening address and whether it is protected (never the key)."""
    if api_key:
        state = "protected (key: set; clients send 'Authorization: Bearer <key>')"
    elif is_loopback(_host_of(url)):
        state = "loopback only, no key"
    else:
        state = "OPEN: no key, reachable from the network"
    return f"listening: {url} ({what}), {state}"


def _host_of(url: str) -> str:
    netloc = url.split("://", 1)[-1].split("/", 1)[0]
    if netloc.startswith("["):
        return netloc[1 : netloc.index("]")]
    return netloc.rsplit(":", 1)[0]


# `key=` (or `api_key=`, `apikey=`) in a query string, a URL or a logged ASGI scope.
_KEY_IN_QUERY = re.compile(r"\b((?:api_?)?key=)[^&\s\"'\\]*", re.IGNORECASE)


class _ScrubKeys(logging.Filter):
    """Masks `key=` values in a log record: in its string arguments (the access log keeps
    its argument tuple, which its formatter unpacks), else in the formatted message."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if all(isinstance(a, (str, int, float)) for a in args):
            record.msg = _KEY_IN_QUERY.sub(r"\1***", str(record.msg))
            record.args = tuple(
                _KEY_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in args
            )
        else:  # e.g. uvicorn's trace log of a whole ASGI scope (its query_string)
            record.msg, record.args = _KEY_IN_QUERY.sub(r"\1***", record.getMessage()), ()
        return True


def scrub_keys(*loggers: str) -> None:
    """Mask `key=` in what `loggers` write (default: uvicorn's access, error and ASGI trace
    logs); call after uvicorn.Config, which configures them."""
    for name in loggers or ("uvicorn.access", "uvicorn.error", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ScrubKeys) for f in logger.filters):
            logger.addFilter(_ScrubKeys())


def key_matches(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>` (constant-time compare)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    )


# -- connections: no idle client can use them up ------------------------------------------------


class ConnectionCap:
    """socketserver mixin: a thread per connection, at most `max_connections` at once.

    A connection is *waiting* until its request has arrived (and again between keep-alive
    requests), then *answered*. When every slot is taken, a new connection closes the
    connection that has waited longest, so idle or trickling sockets make room for clients
    that send a request; only when every slot is answering does a new one get `busy_body`
    with a 503. A connection waiting longer than `request_timeout` is closed. Handlers
    derive from `CappedHandler`, which says when a request has arrived.
    """

    max_connections = 64
    request_timeout = 30.0  # seconds to deliver a request's head and body, or to send the next
    busy_body = b'{"error": "too many connections; retry shortly"}'

    def server_activate(self) -> None:
        self._cap_lock = threading.Lock()
        self._waiting: dict[Any, float] = {}  # connection -> since when, oldest first
        self._closing: set[Any] = set()  # closed to make room, their threads not yet done
        self._serving = 0
        super().server_activate()  # type: ignore[misc]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._cap_lock:
            room = self._serving - len(self._closing) < self.max_connections
            victim = None
            if not room and self._waiting and len(self._closing) < self.max_connections:
                victim = next(iter(self._waiting))
                del self._waiting[victim]
                self._closing.add(victim)
            admitted = room or victim is not None
            if admitted:
                self._serving += 1
                self._waiting[request] = time.monotonic()
        if victim is not None:
            _hang_up(victim)
        if not admitted:
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                    % (len(self.busy_body), self.busy_body)
                )
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._forget(request)

    def request_arrived(self, request: Any) -> None:
        """`request`'s connection has sent its whole request: it is being answered."""
        with self._cap_lock:
            self._waiting.pop(request, None)

    def request_answered(self, request: Any) -> None:
        """`request`'s connection waits for its next request (keep-alive)."""
        with self._cap_lock:
            if request not in self._closing:
                self._waiting.pop(request, None)
                self._waiting[request] = time.monotonic()  # now the newest

    def service_actions(self) -> None:
        """Between accepts (serve_forever's loop): close connections that waited too long."""
        deadline = time.monotonic() - self.request_timeout
        with self._cap_lock:
            late = [c for c, since in self._waiting.items() if since < deadline]
            for conn in late:
                del self._waiting[conn]
                self._closing.add(conn)
        for conn in late:
            _hang_up(conn)
        super().service_actions()  # type: ignore[misc]

    def _forget(self, request: Any) -> None:
        with self._cap_lock:
            self._serving -= 1
            self._waiting.pop(request, None)
            self._closing.discard(request)


def _hang_up(conn: socket.socket) -> None:
    """End a connection another thread may be reading: its read returns at once."""
    with contextlib.suppress(OSError):  # closed meanwhile (the object, never a reused fd)
        conn.shutdown(socket.SHUT_RDWR)


class CappedHandler:
    """http.server handler mixin for a `ConnectionCap` server: a request counts as arrived
    once its head is parsed (a GET) or its body is read (`read_json`)."""

    def handle_one_request(self) -> None:
        super().handle_one_request()  # type: ignore[misc]
        self.server.request_answered(self.request)  # type: ignore[attr-defined]

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # type: ignore[misc]
        if parsed and self.command != "POST":  # type: ignore[attr-defined]
            self.server.request_arrived(self.request)  # type: ignore[attr-defined]
        return parsed

    def read_json(self, limits: JsonLimits) -> Any:
        """The request's JSON body (`read_json_body`); the request has then arrived."""
        value = read_json_body(self.headers, self.rfile, limits)  # type: ignore[attr-defined]
        self.server.request_arrived(self.request)  # type: ignore[attr-defined]
        return value


# -- uvicorn listeners ----------------------------------------------------------------------------


def open_connections_cap() -> int:
    """Open connections past which a uvicorn listener closes idle ones to make room: the
    process's open-files limit (raised first to its hard limit, at most 64k, as Go servers
    do) less room for one burst of accepts (asyncio accepts up to 2048 before any is seen),
    at most 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, (soft - 2048) // 2 if soft > 4096 else soft // 4))


def head_timeout_protocol() -> type:
    """uvicorn's h11 protocol with two guards against clients that never send a request.

    A connection must send each request head within HEAD_TIMEOUT (after a response: within
    its keep-alive time plus HEAD_TIMEOUT); uvicorn times out only keep-alive connections
    that send nothing, and any byte resets that timer, so a socket that sends nothing, or a
    head a byte at a time, would be held for good. And past `open_connections_cap()` open
    connections (which also lifts the open-files limit), each new one closes the one that
    has waited longest for its request head, so idle sockets cannot use up the file
    descriptors and stop the server accepting.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = open_connections_cap()

    class HeadTimeoutH11(H11Protocol):
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._waiting_now()
            if len(self.connections) > cap:
                waiting = self._waiting()
                oldest = next(iter(waiting))
                if oldest is not self:
                    del waiting[oldest]
                    oldest.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request head is in
                self._waiting().pop(self, None)
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # IDLE unless a pipelined request is already being answered.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._waiting_now(self.timeout_keep_alive + HEAD_TIMEOUT)

        def connection_lost(self, exc: Exception | None) -> None:
            self._waiting().pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _waiting(self) -> dict[Any, None]:
            """This server's connections waiting for a request head, oldest first."""
            state = self.server_state
            if not hasattr(state, "masenvs_waiting"):
                state.masenvs_waiting = {}
            return state.masenvs_waiting

        def _waiting_now(self, seconds: float | None = None) -> None:
            waiting = self._waiting()
            waiting.pop(self, None)
            waiting[self] = None  # the newest
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(seconds or HEAD_TIMEOUT, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            # IDLE: no complete request head since the connection or the last response.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutH11
