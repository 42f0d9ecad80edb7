"""The only way out of a design's sandbox: a Unix socket that forwards chat calls to one rollout.

A design runs with no network. Its LLM calls go to a Unix socket whose random name only
this run is told; the gate behind it forwards `POST /v1/chat/completions` to the capture
endpoint's `/r/{rollout_id}/v1` (so every call is recorded under that rollout), after
checking the model name against the allowed ones (`executor`, or `executor@node`, which
the trace records as the call's step) and counting the call against the
design's budget. `POST /v1/tools/python` runs the Python tool of tool-using nodes in a
fresh sandbox process (`masenvs.mas.tools`), within its own budget. Everything else is refused: other paths and rollouts (403/404), unknown
models and streaming (400), calls over the budget (429), bodies without a length or over
`MAX_BODY` (411/413, before they are read) or that would parse into more than `LIMITS`
(413, counted before parsing). Connections that send no request are closed to make room
for the design's calls (`ConnectionCap`).

The gate also enforces the env's sampling settings: a design's calls become the executor's
training samples, so they must be drawn as the env says (n=1, its max_tokens and
temperature, nothing that bends the distribution such as `ignore_eos` or `logit_bias`).
Every field it drops or overrides is sent along in the `X-Masenvs-Gate` header, and the
endpoint keeps it in the call's record (`metadata["gate"]`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from masenvs.listeners import CappedHandler, ConnectionCap
from masenvs.request_bodies import BodyError, JsonLimits, parse_json

GATE_DIR = Path(os.environ.get("MASENVS_GATE_DIR", "/var/tmp/masenvs-gates"))
_UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path is 108, with its NUL)
MAX_BODY = 4 << 20  # bytes of one request
MAX_CONNECTIONS = 64  # connections one gate serves at once (a design's parallel calls)
# A chat request: its messages, tools and their schemas, not the million dicts of 4 MB of
# `[{},...]` (+109 MB each before this count, 64 connections at once).
LIMITS = JsonLimits(max_bytes=MAX_BODY, max_containers=10_000, max_items=50_000)
_NODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
GATE_HEADER = "X-Masenvs-Gate"  # what the gate changed in a request, as JSON
# Request fields a design may set: none of them changes how tokens are drawn. Everything
# else (n, top_p, seed, ignore_eos, min_tokens, logit_bias, penalties, ...) is dropped;
# max_tokens, temperature and repetition_penalty are the env's.
_KEPT = frozenset(
    {"model", "messages", "stop", "tools", "tool_choice", "parallel_tool_calls", "user"}
)


_client: Any = None
_client_lock = threading.Lock()


def _http() -> Any:
    """One keep-alive client for every gate (thread-safe): a gate per execution would
    otherwise build a client, its TLS context and its connections each time."""
    global _client
    with _client_lock:
        if _client is None:
            import httpx

            _client = httpx.Client()
        return _client


class _Server(ConnectionCap, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A thread per connection, at most MAX_CONNECTIONS at once: a design that opens
    thousands of connections must not start thousands of threads in the trainer, and idle
    ones make room for calls."""

    daemon_threads = True
    request_queue_size = 256
    max_connections = MAX_CONNECTIONS
    request_timeout = 60.0
    busy_body = b'{"error": {"message": "too many connections to the gate", "code": 503}}'
    gate: Gate


class Gate:
    """Forwards one rollout's chat calls from a Unix socket to the capture endpoint.

    `models` maps the model names the design may send to the policy name the endpoint
    serves (e.g. {"executor": "executor"}); `max_calls` bounds the calls forwarded.
    """

    def __init__(
        self,
        endpoint_url: str,
        rollout_id: str,
        models: dict[str, str],
        *,
        max_calls: int | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_tokens: int | None = None,
        temperature: float | None = None,
        max_tool_runs: int | None = None,
        repetition_penalty: float | None = None,
    ) -> None:
        """`max_tokens` / `temperature` / `repetition_penalty`: the env's settings every call
        is sent with (None: the endpoint's default, whatever the design asks).
        `max_tool_runs` bounds the runs of the Python tool (`POST /v1/tools/python`)."""
        if "/" in rollout_id or not rollout_id:
            raise ValueError(f"bad rollout id {rollout_id!r}")
        self.target = f"{endpoint_url.rstrip('/')}/r/{rollout_id}/v1/chat/completions"
        self.rollout_id, self.models, self.max_calls = rollout_id, dict(models), max_calls
        self.calls = 0
        self.max_tool_runs, self.tool_runs = max_tool_runs, 0
        self.refused: list[str] = []  # why each refused request was refused
        # (node tag, trace id) of each call the endpoint answered: the design's graph takes
        # its per-node calls from here, not from what the design reports.
        self.call_ids: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self.sampling: dict[str, Any] = {"n": 1}
        if max_tokens is not None:
            self.sampling["max_tokens"] = max_tokens
        if temperature is not None:
            self.sampling["temperature"] = temperature
        if repetition_penalty is not None:
            self.sampling["repetition_penalty"] = repetition_penalty
        # The directory is searchable but not listable by the sandbox uid (0711), so a
        # design reaches only a socket whose name it was given.
        GATE_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(GATE_DIR, 0o711)
        self.path = str(GATE_DIR / f"{secrets.token_hex(16)}.sock")
        if len(os.fsencode(self.path)) > _UNIX_PATH_MAX:
            raise ValueError(
                f"MASENVS_GATE_DIR={GATE_DIR} is too long for a unix socket: its sockets' paths "
                f"would be {len(os.fsencode(self.path))} bytes, at most {_UNIX_PATH_MAX} fit; "
                "choose a shorter directory"
            )
        self._server = _Server(self.path, _Handler)
        os.chmod(self.path, 0o666)  # the sandbox runs under a uid of its own
        self._server.gate = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            daemon=True,
            name=f"mas-gate-{rollout_id}",
        )
        self._thread.start()

    def forward(self, path: str, body: bytes) -> tuple[int, dict[str, Any] | bytes]:
        """The status and body to answer a request for `path` with."""
        if path.startswith("/r/"):
            return self._refuse(
                403, "this gate serves only its own rollout; use /v1/chat/completions"
            )
        if path.rstrip("/") == "/v1/tools/python":
            return self.run_tool(body)
        if path.rstrip("/") != "/v1/chat/completions":
            return self._refuse(
                404, f"the gate forwards only POST /v1/chat/completions, not {path}"
            )
        try:
            request = parse_json(body, LIMITS)
        except BodyError as exc:
            return self._refuse(exc.status, f"{exc}: send a JSON chat request with a model")
        if not isinstance(request, dict) or "model" not in request:
            return self._refuse(400, "the body must be a JSON chat request with a model")
        model = request["model"]
        name, _, node = str(model).partition("@")
        if name not in self.models or (node and not _NODE.fullmatch(node)):
            return self._refuse(
                400,
                f"unknown model {model!r}; this design may call {sorted(self.models)}"
                " (optionally as NAME@node)",
            )
        if request.get("stream"):
            return self._refuse(400, "streaming is not available to designs")
        with self._lock:
            if self.max_calls is not None and self.calls >= self.max_calls:
                return self._refuse(
                    429, f"the design's budget of {self.max_calls} LLM calls is spent"
                )
            self.calls += 1
        # The node's name travels as the call's step (`executor@solver`): the trace
        # names the node of every call; the policy is the executor's either way.
        request["model"] = f"{self.models[name]}@{node}" if node else self.models[name]
        request, changed = self.enforce(request)
        headers = dict(self._headers)
        if changed:
            headers[GATE_HEADER] = json.dumps(changed, separators=(",", ":"))
        try:
            reply = _http().post(self.target, json=request, headers=headers, timeout=self._timeout)
        except Exception as exc:  # the endpoint is down: the design fails with this reason
            return self._refuse(502, f"the endpoint did not answer: {type(exc).__name__}: {exc}")
        if reply.status_code == 200:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                call_id = str(reply.json()["id"])
                with self._lock:
                    self.call_ids.append((node, call_id))
        return reply.status_code, reply.content

    def run_tool(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Run the design's Python (`{"code": ...}`) in a fresh sandbox process, out here:
        a design's own sandbox cannot start one. Counted against `max_tool_runs`."""
        from masenvs.mas.tools import run_python

        try:
            request = parse_json(body, LIMITS)
        except BodyError as exc:
            return self._refuse(exc.status, f'{exc}: send JSON {{"code": "..."}}')
        code = request.get("code") if isinstance(request, dict) else None
        if not isinstance(code, str):
            return self._refuse(400, 'the body must be JSON {"code": "..."}')
        with self._lock:
            if self.max_tool_runs is not None and self.tool_runs >= self.max_tool_runs:
                return self._refuse(
                    429, f"the design's budget of {self.max_tool_runs} tool runs is spent"
                )
            self.tool_runs += 1
        result = run_python(code)
        return 200, {"observation": result.observation(), **result.to_dict()}

    def enforce(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request as it is forwarded (the env's sampling settings, only `_KEPT` fields
        besides) and what changed: {field: what the design asked} ("dropped" or a value)."""
        out = {k: v for k, v in request.items() if k in _KEPT}
        changed: dict[str, Any] = {k: _short(v) for k, v in request.items() if k not in _KEPT}
        for key, value in self.sampling.items():
            out[key] = value
            if key in request and request[key] == value:
                del changed[key]
        return out, changed

    def _refuse(self, status: int, message: str) -> tuple[int, dict[str, Any]]:
        self.refused.append(f"{status}: {message}")
        return status, {"error": {"message": message, "type": "gate_error", "code": status}}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(value: Any) -> Any:
    """A field's value as the trace shows it: scalars as they are, anything else cut short."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:200] + "..."


class _Handler(CappedHandler, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 60  # seconds a design may stall mid-request before its connection is closed

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        # A body is read only with a valid length within the cap: a missing or negative
        # length, or a chunked body, would read to EOF, as long as the design keeps sending.
        length = self.headers.get("content-length", "").strip()
        refusal = None
        if self.headers.get("transfer-encoding"):
            refusal = 411, "chunked bodies are not accepted: send Content-Length"
        elif not length.isdigit():
            refusal = 411, "a POST needs a Content-Length: a non-negative number of bytes"
        elif int(length) > MAX_BODY:
            refusal = 413, f"request too large: the gate takes at most {MAX_BODY} bytes"
        if refusal is not None:
            self.close_connection = True  # the unread body must not be parsed as a request
            status, message = refusal
            self._answer(*self.server.gate._refuse(status, message))
            return
        body = self.rfile.read(int(length))
        self.server.request_arrived(self.request)
        self._answer(*self.server.gate.forward(self.path, body))

    def do_GET(self) -> None:  # noqa: N802
        self._answer(*self.server.gate.forward(self.path, b""))

    def _answer(self, status: int, body: dict[str, Any] | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def address_string(self) -> str:  # a Unix socket has no client address
        return "design"
