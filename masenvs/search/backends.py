"""Search backends: embedded BM25 (bm25s), an HTTP retriever in FlashRAG's `/retrieve` shape,
a plain-Python BM25 (the benchmark's baseline), or anything with `search(queries, k)`."""

from __future__ import annotations

import heapq
import importlib
import json
import math
import os
import re
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from masenvs.listeners import SEARCH_API_KEY_ENV
from masenvs.search.data import Doc


class SearchError(RuntimeError):
    """A search backend failed; never replaced by made-up results."""


@dataclass(frozen=True)
class Hit:
    id: str
    contents: str
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {"document": {"id": self.id, "contents": self.contents}, "score": self.score}


@runtime_checkable
class SearchBackend(Protocol):
    """What web_search needs: the top `k` hits of each query, best first."""

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


_TOKEN = re.compile(r"\w+")
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "for",
        "from",
        "has",
        "he",
        "in",
        "is",
        "it",
        "its",
        "of",
        "on",
        "or",
        "she",
        "that",
        "the",
        "to",
        "was",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "whose",
        "why",
        "how",
        "will",
        "with",
        "this",
        "these",
        "those",
        "there",
        "their",
    ]
)


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens without English stopwords (the same for corpus and queries)."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


class BM25Backend:
    """BM25 over an in-memory corpus with `bm25s` (Lucene scoring, k1=1.5, b=0.75)."""

    def __init__(self, docs: Sequence[Doc], k1: float = 1.5, b: float = 0.75) -> None:
        try:
            import bm25s
        except ImportError as exc:
            raise ImportError(
                "the bm25 search backend needs bm25s: pip install 'masenvs[search]'"
            ) from exc
        if not docs:
            raise ValueError("BM25Backend needs at least one document")
        self.docs = list(docs)
        self._bm25s = bm25s
        self.index = bm25s.BM25(k1=k1, b=b)
        self.index.index([tokenize(d.contents) for d in self.docs], show_progress=False)
        self._vocab = self.index.vocab_dict

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """All queries in one bm25s call; a query with no corpus word gets no hits."""
        k = min(k, len(self.docs))
        tokens = [[t for t in tokenize(q) if t in self._vocab] for q in queries]
        asked = [i for i, t in enumerate(tokens) if t]
        out: list[list[Hit]] = [[] for _ in queries]
        if not asked:
            return out
        ids, scores = self.index.retrieve(
            [tokens[i] for i in asked], k=k, show_progress=False, n_threads=1
        )
        for row, i in enumerate(asked):
            out[i] = [
                Hit(self.docs[d].id, self.docs[d].contents, float(s))
                for d, s in zip(ids[row].tolist(), scores[row].tolist())
                if s > 0
            ]
        return out


class PlainBM25:
    """The same BM25 in plain Python (an inverted index and a heap): the benchmark's baseline."""

    def __init__(self, docs: Sequence[Doc], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs = list(docs)
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        lengths = []
        for i, doc in enumerate(self.docs):
            tokens = tokenize(doc.contents)
            lengths.append(len(tokens))
            for token, tf in Counter(tokens).items():
                self.postings[token].append((i, tf))
        n, avg = len(self.docs), sum(lengths) / max(1, len(lengths))
        self.idf = {
            t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()
        }
        self.norm = [k1 * (1 - b + b * length / avg) for length in lengths]
        self.k1 = k1

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        out = []
        for query in queries:
            scores: dict[int, float] = defaultdict(float)
            for token in set(tokenize(query)):
                idf = self.idf.get(token)
                if idf is None:
                    continue
                for i, tf in self.postings[token]:
                    scores[i] += idf * tf / (tf + self.norm[i])  # bm25s "lucene" scores
            best = heapq.nlargest(k, scores.items(), key=lambda item: item[1])
            out.append([Hit(self.docs[i].id, self.docs[i].contents, s) for i, s in best])
        return out


class HttpBackend:
    """A retriever at `url` speaking FlashRAG/Search-R1's `/retrieve`: POST
    {"queries", "topk", "return_scores": true} -> {"result": [[{"document", "score"}]]};
    `api_key` (default $MASENVS_SEARCH_API_KEY) goes as `Authorization: Bearer KEY`."""

    def __init__(self, url: str, timeout: float = 30.0, api_key: str | None = None) -> None:
        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout = timeout
        self.api_key = api_key or os.environ.get(SEARCH_API_KEY_ENV)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        body = json.dumps({"queries": list(queries), "topk": k, "return_scores": True})
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, body.encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise SearchError(
                f"search server {self.url} answered HTTP {exc.code} ({detail}): check the server"
            ) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SearchError(
                f"search server {self.url} unreachable or not JSON ({exc}): start one with "
                "`masenvs search-serve CORPUS.jsonl --port P` or fix search_url"
            ) from exc
        results = data.get("result") if isinstance(data, dict) else data
        if not isinstance(results, list) or len(results) != len(queries):
            raise SearchError(
                f"search server {self.url} sent {type(results).__name__} for {len(queries)} "
                "queries: it must answer FlashRAG's /retrieve shape"
            )
        try:
            return [[_hit(item) for item in per_query] for per_query in results]
        except (KeyError, TypeError, ValueError) as exc:
            raise SearchError(
                f"search server {self.url} sent a malformed hit ({exc!r}): each must be "
                '{"document": {"id", "contents"}, "score"}'
            ) from exc


def _hit(item: dict[str, Any]) -> Hit:
    doc = item.get("document", item)
    contents = doc.get("contents")
    if contents is None:  # {"title", "text"} documents
        contents = f'"{doc.get("title", "")}"\n{doc["text"]}'
    return Hit(str(doc.get("id", "")), str(contents), float(item.get("score", 0.0)))


def load_backend(spec: str) -> SearchBackend:
    """A backend from an import path, "module:attr": a backend object or a no-argument factory."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"search_backend {spec!r} must be 'module:attr'")
    obj = getattr(importlib.import_module(module), attr)
    backend = obj() if isinstance(obj, type) or not hasattr(obj, "search") else obj
    if not isinstance(backend, SearchBackend):
        raise TypeError(f"{spec} gave {type(backend).__name__}, which has no search(queries, k)")
    return backend
