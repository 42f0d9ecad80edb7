"""`masenvs search-serve CORPUS.jsonl --port P`: BM25 over a corpus behind FlashRAG's
`/retrieve` (POST {"queries", "topk", "return_scores"} -> {"result": [[{"document", "score"}]]}).

Every request is bounded: a Content-Length is required and capped (411/413 before the body
is read), JSON nests at most 64 levels, `topk` is 1..--max-topk, queries are counted and
capped, and the body is counted before it is parsed (at most a few objects and 1k values).
Beyond loopback it needs a key, from `--api-key-file PATH` or $MASENVS_SEARCH_API_KEY (never
the command line), or `--no-auth`. Idle or trickling connections are closed to make room
for clients that send a request (`ConnectionCap`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from masenvs.listeners import (
    SEARCH_API_KEY_ENV,
    CappedHandler,
    ConnectionCap,
    ListenerError,
    add_listener_arguments,
    announce,
    key_from,
    key_matches,
    listener_key,
)
from masenvs.request_bodies import BodyError, JsonLimits
from masenvs.search.backends import BM25Backend, SearchBackend
from masenvs.search.data import load_corpus_jsonl

MAX_BODY = 1 << 20  # bytes of one /retrieve request
MAX_QUERIES = 256  # queries in one request
MAX_QUERY_CHARS = 4096  # characters of one query
MAX_TOPK = 100  # documents per query, unless the server is started with another --max-topk
MAX_CONNECTIONS = 128  # connections served at once (a thread each; idle ones make room)
# {"queries": [...], "topk": k, "return_scores": b}: two containers and MAX_QUERIES strings,
# with room for a client's extra fields; 1 MB of `[{},...]` would be 350k dicts.
LIMITS = JsonLimits(max_bytes=MAX_BODY, max_containers=16, max_items=2 * MAX_QUERIES + 64)


def make_server(
    backend: SearchBackend,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    max_topk: int = MAX_TOPK,
) -> ThreadingHTTPServer:
    """An HTTP server answering /retrieve from `backend` (port 0 picks a free port); with
    `api_key`, /retrieve answers 401 unless the request sends `Authorization: Bearer KEY`."""
    lock = threading.Lock()  # bm25s indexes are not documented as thread-safe

    class Handler(CappedHandler, BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30  # a client that stalls mid-request loses its connection

        def _send(self, status: int, payload: Any, *, close: bool = False) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if close:  # an unread body must not be read as the next request
                self.send_header("Connection", "close")
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"no GET {self.path}: POST /retrieve"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"no POST {self.path}: POST /retrieve"}, close=True)
                return
            if api_key and not key_matches(self.headers.get("Authorization"), api_key):
                self._send(401, {"error": "send 'Authorization: Bearer <key>'"}, close=True)
                return
            try:
                request = self.read_json(LIMITS)
                queries, topk, scores = parse_request(request, max_topk)
            except BodyError as exc:
                self._send(exc.status, {"error": str(exc)}, close=exc.status != 400)
                return
            except ValueError as exc:
                self._send(
                    400, {"error": f"bad request ({exc}): send {{'queries': [...], 'topk': k}}"}
                )
                return
            with lock:
                results = backend.search(queries, topk)
            if scores:
                payload = [[h.to_dict() for h in hits] for hits in results]
            else:
                payload = [[h.to_dict()["document"] for h in hits] for hits in results]
            self._send(200, {"result": payload})

        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            pass

    return _Server((host, port), Handler)


class _Server(ConnectionCap, ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once: idle sockets held open by
    one client can neither make the server start thousands of threads nor lock others out."""

    request_queue_size = 1024  # socketserver's 5 drops bursts of connects (1-7 s SYN retries)
    max_connections = MAX_CONNECTIONS


def parse_request(request: Any, max_topk: int = MAX_TOPK) -> tuple[list[str], int, bool]:
    """A /retrieve body's queries, topk and return_scores, checked (ValueError says what)."""
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object")
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("'queries' must be a list of strings")
    if not 1 <= len(queries) <= MAX_QUERIES:
        raise ValueError(f"send 1 to {MAX_QUERIES} queries, not {len(queries)}")
    if any(len(q) > MAX_QUERY_CHARS for q in queries):
        raise ValueError(f"a query is longer than {MAX_QUERY_CHARS} characters")
    topk = request.get("topk", 3)
    if topk is None:
        topk = 3
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= max_topk:
        raise ValueError(f"'topk' must be an integer from 1 to {max_topk}, not {topk!r}")
    scores = request.get("return_scores", False)
    if not isinstance(scores, bool):
        raise ValueError("'return_scores' must be true or false")
    return queries, topk, scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="masenvs search-serve", description="Serve BM25 over a corpus JSONL at /retrieve."
    )
    parser.add_argument("corpus", help='JSONL of {"id","contents"} or {"id","title","text"}')
    add_listener_arguments(parser, SEARCH_API_KEY_ENV)  # --api-key-file PATH or its env var
    parser.add_argument(
        "--max-topk", type=int, default=MAX_TOPK, help=f"most documents per query ({MAX_TOPK})"
    )
    args = parser.parse_args(argv)
    try:
        key = listener_key(
            args.host,
            key_from(args, SEARCH_API_KEY_ENV),
            what="the search server",
            no_auth=args.no_auth,
            key_flag=f"--api-key-file PATH (or set ${SEARCH_API_KEY_ENV})",
        )
    except ListenerError as exc:
        print(f"masenvs search-serve: {exc}", file=sys.stderr)
        return 2
    if args.max_topk < 1:
        print("masenvs search-serve: --max-topk must be at least 1", file=sys.stderr)
        return 2
    docs = load_corpus_jsonl(args.corpus)
    try:
        server = make_server(
            BM25Backend(docs), args.host, args.port, api_key=key, max_topk=args.max_topk
        )
    except OSError as exc:
        print(f"masenvs search-serve: cannot listen on {args.host}:{args.port}: {exc}")
        return 1
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in str(host) else host
    url = f"http://{host}:{port}/retrieve"
    print(f"serving BM25 over {len(docs)} documents at {url}", flush=True)
    print(announce("search-serve", url, key), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
