"""The endpoint's HTTP wire: request bodies in (size-capped, parsed), JSON and errors out."""

from __future__ import annotations

import json
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from masenvs.adapters.openai_schema import APIError
from masenvs.engine.protocol import BackendError
from masenvs.request_bodies import BodyError, JsonLimits, JsonTooLarge, parse_json

MAX_BODY_BYTES = 32 << 20
# What one body may parse into: a chat of 50k messages or a prompt of 250k token ids, not
# the ten million dicts of 30 MB of `[{},...]` (+1.4 GB and 15 s of CPU before this count).
LIMITS = JsonLimits(max_bytes=MAX_BODY_BYTES, max_containers=50_000, max_items=250_000)
MAX_BUFFERED_BYTES = 256 << 20  # bodies held while they arrive, all requests together


def dumps(body: Any) -> bytes:
    """Compact UTF-8 JSON, as every response and stream chunk is written."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class JSON(JSONResponse):
    """A JSON response written by `dumps` (non-ASCII text kept as is)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


def error_response(error: APIError) -> Response:
    return JSON(error.body(), status_code=error.status)


def from_backend(error: BackendError) -> APIError:
    """A backend's error as the OpenAI error the client sees (its status, else 500)."""
    status = error.status if 400 <= error.status < 600 else 500
    return APIError(
        status,
        str(error),
        type="invalid_request_error" if status < 500 else "server_error",
        code=error.code,
    )


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (413) as soon as it passes `limit` bytes: the length a
    client announces is checked first, and a chunked body is counted while it streams."""
    length = request.headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        raise APIError(400, "Content-Length must be a non-negative number of bytes.")
    if length is not None and int(length) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body is larger than {limit} bytes.")
            # Many clients uploading at once (slowly, each under the cap) share one budget.
            if not BODIES.take(len(chunk)):
                raise APIError(
                    503,
                    "The server is receiving too many request bodies at once; retry shortly.",
                    type="server_error",
                )
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        BODIES.give(sum(len(c) for c in chunks))


class BodyBudget:
    """Bytes of request bodies being received right now, over every endpoint in the process."""

    def __init__(self) -> None:
        self.held = 0
        self._lock = threading.Lock()  # endpoints in other threads share the budget

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > MAX_BUFFERED_BYTES:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


BODIES = BodyBudget()


def json_body(raw: bytes) -> Any:
    """`raw` parsed as JSON, or a 400 APIError: it would parse into more objects or values
    than any request needs (counted before parsing), it is not JSON or it nests too deep."""
    try:
        return parse_json(raw, LIMITS)
    except JsonTooLarge as exc:
        raise APIError(400, f"The request body is refused before parsing: {exc}.") from None
    except BodyError as exc:
        raise APIError(
            400,
            f"We could not parse the JSON body of your request ({exc}). The body must be "
            f"JSON, nested at most {LIMITS.max_depth} levels, with 'Content-Type: "
            "application/json'.",
        ) from None
