"""The only way out of a design's sandbox: a Unix socket that forwards chat calls to one rollout.

A design runs with no network. Its LLM calls go to a Unix socket whose random name only
this run is told; the gate behind it forwards `POST /v1/chat/completions` to the capture
endpoint's `/r/{rollout_id}/v1` (so every call is recorded under that rollout), after
checking the model name against the allowed ones (`executor`, or `executor@node`, which
the trace records as the call's step) and counting the call against the
design's budget. Everything else is refused: other paths and rollouts (403/404), unknown
models and streaming (400), calls over the budget (429).
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

GATE_DIR = Path(os.environ.get("MASENVS_GATE_DIR", "/var/tmp/masenvs-gates"))
MAX_BODY = 4 << 20  # bytes of one request
_NODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


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


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
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
    ) -> None:
        if "/" in rollout_id or not rollout_id:
            raise ValueError(f"bad rollout id {rollout_id!r}")
        self.target = f"{endpoint_url.rstrip('/')}/r/{rollout_id}/v1/chat/completions"
        self.rollout_id, self.models, self.max_calls = rollout_id, dict(models), max_calls
        self.calls = 0
        self.refused: list[str] = []  # why each refused request was refused
        self._lock = threading.Lock()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        # The directory is searchable but not listable by the sandbox uid (0711), so a
        # design reaches only a socket whose name it was given.
        GATE_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(GATE_DIR, 0o711)
        self.path = str(GATE_DIR / f"{secrets.token_hex(16)}.sock")
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
        if path.rstrip("/") != "/v1/chat/completions":
            return self._refuse(
                404, f"the gate forwards only POST /v1/chat/completions, not {path}"
            )
        try:
            request = json.loads(body)
            model = request["model"]
        except (ValueError, KeyError, TypeError):
            return self._refuse(400, "the body must be a JSON chat request with a model")
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
        try:
            reply = _http().post(
                self.target, json=request, headers=self._headers, timeout=self._timeout
            )
        except Exception as exc:  # the endpoint is down: the design fails with this reason
            return self._refuse(502, f"the endpoint did not answer: {type(exc).__name__}: {exc}")
        return reply.status_code, reply.content

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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            self._answer(413, {"error": {"message": "request too large", "code": 413}})
            self.close_connection = True
            return
        status, body = self.server.gate.forward(self.path, self.rfile.read(length))
        self._answer(status, body)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(*self.server.gate.forward(self.path, b""))

    def _answer(self, status: int, body: dict[str, Any] | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def address_string(self) -> str:  # a Unix socket has no client address
        return "design"
