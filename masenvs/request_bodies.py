"""Request bodies bounded in bytes and in what they parse into, for every masenvs listener.

`parse_json` counts the objects, arrays and values a body would parse into before parsing it
(a 30 MB `[{},{},...]` is ten million dicts), and `read_json_body` reads a body that
http.server's handlers receive, refusing a missing, negative or oversized length before
reading a byte of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

MAX_JSON_DEPTH = 64  # nesting no request of ours needs; deeper input is an attack


class BodyError(ValueError):
    """A request body refused before or while reading it: `status` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class JsonTooLarge(BodyError):
    """A JSON body that would parse into more objects, values or levels than allowed (400:
    no request needs them; 413 stays for bytes)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


@dataclass(frozen=True)
class JsonLimits:
    """What one request body may hold. Bytes alone do not bound memory: each `{}` of a
    `[{},{},...]` body is 3 bytes on the wire and a 64-byte dict once parsed."""

    max_bytes: int
    max_containers: int = 10_000  # objects and arrays
    max_items: int = 100_000  # values and keys (a list of a million token ids is a million)
    max_depth: int = MAX_JSON_DEPTH


_STRING = re.compile(rb'"[^"]*"')  # a JSON string once its escaped quotes are removed


def json_size(raw: bytes | bytearray) -> tuple[int, int]:
    """(objects and arrays, values and keys) that `raw` would parse into, counted without
    parsing: `{[,:` outside strings (each starts a value or key) plus the root."""
    outside = _STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b""))
    containers = outside.count(b"{") + outside.count(b"[")
    return containers, containers + outside.count(b",") + outside.count(b":") + 1


def check_json_size(raw: bytes | bytearray, limits: JsonLimits) -> None:
    """BodyError if `raw` is over `limits`: 413 over its bytes, JsonTooLarge (400) if it
    would parse into more objects or values. Counting bytes runs at memory speed; strings
    are skipped only when a raw count is over a limit, and only once their number is known
    to be within it."""
    if len(raw) > limits.max_bytes:
        raise BodyError(413, f"request too large: at most {limits.max_bytes} bytes")
    containers = raw.count(b"{") + raw.count(b"[")  # brackets in strings counted too
    items = containers + raw.count(b",") + raw.count(b":") + 1
    if containers <= limits.max_containers and items <= limits.max_items:
        return
    strings = 0
    if b'"' in raw:  # else the counts are exact already
        unescaped = raw.replace(b"\\\\", b"")
        strings = (unescaped.count(b'"') - unescaped.count(b'\\"')) // 2  # values or keys
        if strings <= limits.max_items:
            containers, items = json_size(raw)
    if containers > limits.max_containers:
        if re.match(rb"(?:\s*[\[{]){%d}" % (limits.max_depth + 1), raw):  # `[[[[...`
            raise JsonTooLarge(f"the JSON body is nested deeper than {limits.max_depth} levels")
        raise JsonTooLarge(
            f"the JSON body holds {containers} objects and arrays; at most "
            f"{limits.max_containers} are accepted"
        )
    if max(items, strings) > limits.max_items:
        raise JsonTooLarge(
            f"the JSON body holds {max(items, strings)} values; at most {limits.max_items} "
            "are accepted"
        )


def parse_json(raw: bytes | bytearray | str, limits: JsonLimits) -> Any:
    """`raw` as JSON, or BodyError: 413 over `limits.max_bytes`, 400 if it would parse into
    more than `limits` allow (counted before parsing), is not JSON or nests too deep."""
    data = raw.encode() if isinstance(raw, str) else raw
    check_json_size(data, limits)
    try:
        value = json.loads(data)
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise BodyError(
            400, f"the JSON body is nested deeper than {limits.max_depth} levels"
        ) from None
    except (ValueError, UnicodeDecodeError):
        raise BodyError(400, "the body is not JSON") from None
    if json_depth(value) > limits.max_depth:
        raise BodyError(400, f"the JSON body is nested deeper than {limits.max_depth} levels")
    return value


def read_json_body(headers: Any, stream: BinaryIO, limits: JsonLimits) -> Any:
    """A request's JSON body from an http.server handler (`headers`, `rfile`), or BodyError:
    411 without a valid Content-Length (chunked, missing, negative), 413 over
    `limits.max_bytes` (before reading), 400 if it would parse into more than `limits`
    allow, is not JSON or nests deeper than `limits.max_depth`."""
    if headers.get("transfer-encoding"):
        raise BodyError(411, "chunked bodies are not accepted: send Content-Length")
    length = (headers.get("content-length") or "").strip()
    if not length.isdigit():
        raise BodyError(411, "a POST needs a Content-Length: a non-negative number of bytes")
    if int(length) > limits.max_bytes:
        raise BodyError(413, f"request too large: at most {limits.max_bytes} bytes")
    return parse_json(stream.read(int(length)), limits)


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
