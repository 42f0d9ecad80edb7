"""The rules every masenvs listener follows: a key beyond loopback, bounded request bodies.

A port bound to anything but loopback needs an API key: `listener_key` gives the key to
use (the one given, a generated one, or None on loopback) or refuses to start; only an
explicit open flag skips it, with a warning. `announce` is the startup line naming the
address and whether it is protected. `read_json_body` reads a request body that
http.server's handlers receive, refusing a missing, negative or oversized length before
reading a byte of it, and JSON nested deeper than any request needs.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import secrets
import sys
import threading
from typing import Any, BinaryIO

MAX_JSON_DEPTH = 64  # nesting no request of ours needs; deeper input is an attack
API_KEY_ENV = "MASENVS_API_KEY"  # the key of `serve`, its engine servers and the trainer's endpoint


class ListenerError(ValueError):
    """A listener would leave loopback with no key; the message says how to fix it."""


class BodyError(ValueError):
    """A request body refused before or while reading it: `status` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    key_flag: str = "--api-key KEY",
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


def announce(what: str, url: str, api_key: str | None) -> str:
    """The startup line naming a listening address and whether it is protected."""
    if api_key:
        state = "protected (API key required)"
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


def key_matches(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>` (constant-time compare)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    )


def read_json_body(
    headers: Any, stream: BinaryIO, limit: int, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """A request's JSON body from an http.server handler (`headers`, `rfile`), or BodyError:
    411 without a valid Content-Length (chunked, missing, negative), 413 over `limit`
    (before reading), 400 if it is not JSON or nests deeper than `max_depth`."""
    if headers.get("transfer-encoding"):
        raise BodyError(411, "chunked bodies are not accepted: send Content-Length")
    length = (headers.get("content-length") or "").strip()
    if not length.isdigit():
        raise BodyError(411, "a POST needs a Content-Length: a non-negative number of bytes")
    if int(length) > limit:
        raise BodyError(413, f"request too large: at most {limit} bytes")
    return parse_json(stream.read(int(length)), max_depth)


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`raw` as JSON, or BodyError(400): not JSON, or nested deeper than `max_depth`."""
    try:
        value = json.loads(raw)
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise BodyError(400, f"the JSON body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise BodyError(400, "the body is not JSON") from None
    if json_depth(value) > max_depth:
        raise BodyError(400, f"the JSON body is nested deeper than {max_depth} levels")
    return value


def json_depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


class ConnectionCap:
    """socketserver mixin: a thread per connection, at most `max_connections` at once; a
    connection past them gets `busy_body` with a 503 at once, so idle sockets held open by
    one client cannot make the server start thousands of threads."""

    max_connections = 64
    busy_body = b'{"error": "too many connections; retry shortly"}'

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()  # type: ignore[misc]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                    % (len(self.busy_body), self.busy_body)
                )
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._slots.release()
