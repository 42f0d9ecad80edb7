"""`masenvs search-serve CORPUS.jsonl --port P`: BM25 over a corpus behind FlashRAG's
`/retrieve` (POST {"queries", "topk", "return_scores"} -> {"result": [[{"document", "score"}]]})."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from masenvs.search.backends import BM25Backend, SearchBackend
from masenvs.search.data import load_corpus_jsonl


def make_server(
    backend: SearchBackend, host: str = "127.0.0.1", port: int = 8000
) -> ThreadingHTTPServer:
    """An HTTP server answering /retrieve from `backend` (port 0 picks a free port)."""
    lock = threading.Lock()  # bm25s indexes are not documented as thread-safe

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"no GET {self.path}: POST /retrieve"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"no POST {self.path}: POST /retrieve"})
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length))
                queries = request["queries"]
                topk = int(request.get("topk") or 3)
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise ValueError("'queries' must be a list of strings")
            except (KeyError, ValueError, TypeError) as exc:
                self._send(
                    400, {"error": f"bad request ({exc}): send {{'queries': [...], 'topk': k}}"}
                )
                return
            with lock:
                results = backend.search(queries, topk)
            if request.get("return_scores", False):
                payload = [[h.to_dict() for h in hits] for hits in results]
            else:
                payload = [[h.to_dict()["document"] for h in hits] for hits in results]
            self._send(200, {"result": payload})

        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="masenvs search-serve", description="Serve BM25 over a corpus JSONL at /retrieve."
    )
    parser.add_argument("corpus", help='JSONL of {"id","contents"} or {"id","title","text"}')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    docs = load_corpus_jsonl(args.corpus)
    server = make_server(BM25Backend(docs), args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving BM25 over {len(docs)} documents at http://{host}:{port}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
